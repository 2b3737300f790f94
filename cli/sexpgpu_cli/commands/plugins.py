"""``sexpgpu plugins``: every plugin, where it came from, what it implements, whether it works."""

from __future__ import annotations

import json

import click


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="One JSON array, for machines.")
def plugins(as_json: bool) -> None:
    """List installed plugins, their hooks, and whether each is available."""
    from sexpgpu.plugins import get_plugins

    records = get_plugins().records
    if as_json:
        click.echo(json.dumps([r.as_json() for r in records], indent=2))
        return
    width = max((len(r.name) for r in records), default=4)
    for r in records:
        state = "available" if r.available else f"unavailable: {r.reason}"
        click.echo(f"{r.name:<{width}}  {r.distribution} {r.version}  ({r.module})  {state}")
        hooks = ", ".join(h.removeprefix("sexpgpu_") for h in r.hooks if h != "sexpgpu_unavailable")
        click.echo(f"{'':<{width}}  hooks: {hooks or '-'}")

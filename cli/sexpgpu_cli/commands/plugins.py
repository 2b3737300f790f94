"""``sexpgpu plugins``: every plugin, where it came from, whether it works, what it
supplies, and the conflicts and mistakes found among them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

# How a detail of a described descriptor reads in the listing; details not
# named here (name, doc, the parts of the title) are not repeated.
DETAILS: dict[str, Callable[[Any], str]] = {
    "lowering": lambda value: f"{value} lowering",
    "devices": lambda value: "devices " + ", ".join(value),
    "deterministic": lambda value: "deterministic" if value else "non-deterministic",
    "priority": lambda value: f"priority {value}",
    "required": lambda value: ", ".join(f"{k} required" for k in value),
    "options": lambda value: ", ".join(f"{k}={v!r}" for k, v in value.items()) or "no options",
    "lowerings": lambda value: "implemented for " + (", ".join(value) or "no lowering"),
    "choice": lambda value: f"requests {value}",
    "values": lambda value: " | ".join(value),
    "minimum": lambda value: f"an integer >= {value}",
}


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="One JSON array, for machines.")
def plugins(as_json: bool) -> None:
    """List installed plugins, what each supplies, whether each is available, and conflicts."""
    from sexpgpu_cli.group import catalog

    loaded = catalog()
    # asked first: a hook that raises here makes its plugin unavailable, which
    # the records below must already say
    from sexpgpu_cli.describing import supplies as described

    supplies = {record.name: described(loaded, record) for record in loaded.records}
    conflicts = loaded.conflicts()
    listing = [
        (
            record,
            {
                **_record_json(record),
                "supplies": supplies[record.name],
                "conflicts": [c.as_json() for c in conflicts if record.name in c.plugins],
            },
        )
        for record in loaded.records
    ]
    if as_json:
        click.echo(json.dumps([entry for _, entry in listing], indent=2, default=str))
        return
    width = max((len(r.name) for r in loaded.records), default=4)
    for record, entry in listing:
        mine = [c for c in conflicts if record.name in c.plugins]
        for line in _record_lines(record, entry, mine, width):
            click.echo(line)
    if conflicts:
        click.echo("\nconflicts (using the contested thing is refused):")
        for conflict in conflicts:
            click.echo(f"  {conflict.message()}")
    if loaded.warnings:
        click.echo("\nwarnings:")
        for warning in loaded.warnings:
            click.echo(f"  {warning}")


def _record_json(record: Any) -> dict[str, Any]:
    """A plugin's record as ``--json`` prints it (without what it supplies)."""
    fields = ("name", "module", "distribution", "version", "hooks", "available", "refused")
    fields += ("disabled",)
    extra = ("reason", "warnings", "traceback")
    return {name: getattr(record, name) for name in (*fields, *extra)}


def _record_lines(
    record: Any, entry: dict[str, Any], conflicts: list[Any], width: int
) -> list[str]:
    from sexpgpu.plugin_supplies import owner_text
    from sexpgpu_cli.describing import DESCRIBED

    pad = " " * (width + 2)
    state = "available" if record.available else f"{record.state}: {record.reason}"
    lines = [f"{record.name:<{width}}  {record.where}  ({record.module})  {state}"]
    hooks = ", ".join(
        h.removeprefix("sexpgpu_") for h in record.hooks if h != "sexpgpu_unavailable"
    )
    lines.append(f"{pad}hooks: {hooks or '-'}")
    for short, described in entry["supplies"].items():
        kind = DESCRIBED.get(f"sexpgpu_{short}")
        singular = kind.singular if kind else "command"
        lines.extend(f"{pad}{_supply_line(singular, item)}" for item in described)
    for conflict in conflicts:
        others = ", ".join(owner_text(*o) for o in conflict.owners if o[0] != record.name)
        lines.append(f"{pad}conflict: its {conflict.what} is also supplied by {others}")
    lines.extend(f"{pad}warning: {warning}" for warning in record.warnings)
    if record.traceback:
        lines.append(f"{pad}traceback:")
        lines.extend(f"{pad}  {line}" for line in record.traceback.splitlines())
    return lines


def _supply_line(singular: str, item: dict[str, Any]) -> str:
    details = [render(item[key]) for key, render in DETAILS.items() if key in item]
    text = f"{singular} {item['title']}"
    if details:
        text += f" ({'; '.join(details)})"
    doc = item.get("doc") or ""
    return f"{text}: {doc}" if doc else text

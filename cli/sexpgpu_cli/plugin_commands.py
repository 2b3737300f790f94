"""The commands plugins add to ``sexpgpu`` (the ``sexpgpu_cli_commands`` hook), and the
rules they are added by: never over a built-in command, never one of two."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import click

from sexpgpu.catalog import Catalog, PluginRecord
from sexpgpu.plugin_supplies import COMMANDS_HOOK, PROJECT_DISTRIBUTION, Conflict


def add_commands(catalog: Catalog, cli: click.Group, reserved: Collection[str] = ()) -> None:
    """Let every available plugin of ``catalog`` add its subcommands to ``cli``.

    Each plugin adds its commands to a group of its own first, so that what it adds
    is known before anything is replaced: a third-party plugin adding a command named
    in ``reserved`` (the built-in ones) or one sexpgpu's own plugins add (``report``)
    is refused, and a command two plugins
    add is replaced by one that refuses with the conflict (kept in
    ``catalog.command_conflicts`` for ``sexpgpu plugins``). A plugin whose hook raises
    is skipped.
    """
    claims: dict[str, list[tuple[PluginRecord, click.Command]]] = {}
    # sexpgpu's own plugins add theirs first: a third party's is never their equal
    own = sorted(catalog.records, key=lambda r: r.distribution != PROJECT_DISTRIBUTION)
    ours: set[str] = set()
    for record in own:
        if COMMANDS_HOOK not in record.hooks or not record.available:
            continue
        staging = click.Group(name=cli.name)
        try:
            catalog.ask(record, COMMANDS_HOOK, cli=staging)
        except Exception as exc:
            catalog.fail(record, "adding its commands failed", exc)
            continue
        if not record.available:  # refused: its hook returned something
            continue
        record.commands = {
            name: command.get_short_help_str(limit=100)
            for name, command in sorted(staging.commands.items())
        }
        if record.distribution == PROJECT_DISTRIBUTION:
            ours.update(staging.commands)
        taken = sorted(set(staging.commands) & (set(reserved) | ours))
        if taken and record.distribution != PROJECT_DISTRIBUTION:
            listed = ", ".join(f"'{name}'" for name in taken)
            catalog.refuse(
                record,
                f"its command {listed} would replace the built-in one"
                if len(taken) == 1
                else f"its commands {listed} would replace the built-in ones",
            )
            continue
        for name, command in staging.commands.items():
            claims.setdefault(name, []).append((record, command))
    for name, owners in claims.items():
        if len(owners) == 1:
            cli.add_command(owners[0][1], name)
            continue
        conflict = Conflict(
            COMMANDS_HOOK, f"command '{name}'", tuple((r.name, r.where) for r, _ in owners)
        )
        catalog.command_conflicts.append(conflict)
        cli.add_command(_refusing_command(name, conflict), name)


def _refusing_command(name: str, conflict: Conflict) -> Any:
    """A command standing for ``name`` that two plugins add: it only refuses."""

    def refuse() -> None:
        raise conflict.error()

    return click.Command(
        name,
        callback=refuse,
        help=conflict.message(),
        short_help=f"refused: added by {' and '.join(conflict.plugins)} (see `sexpgpu plugins`)",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )

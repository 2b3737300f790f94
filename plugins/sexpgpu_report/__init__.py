"""The report plugin: ``sexpgpu runs`` lists the runs of a metrics folder, and
``sexpgpu report`` draws one (an HTML page and PNGs, plotted by matplotlib).

Written as a third party would write it: it reads the files a run leaves in
``<metrics-dir>/<slug>/`` (``status.json``, ``events.jsonl``) and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sexpgpu.hookspecs import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def sexpgpu_cli_commands(cli: click.Group) -> None:
    """``sexpgpu runs`` and ``sexpgpu report``."""
    from sexpgpu_report.command import report, runs

    cli.add_command(runs)
    cli.add_command(report)

"""Option parsing shared by the commands that compile a `.sx` file."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sexpgpu.opening import parse_requests, parse_sets

__all__ = ["RUN_FOLDER_SINK", "hoist_root_options", "metrics_sinks", "parse_requests", "parse_sets"]

RUN_FOLDER_SINK = "jsonl"
"""The sink writing ``<metrics-dir>/<slug>/events.jsonl``, which ``sexpgpu runs``,
``report`` and ``evaluate --follow`` read: kept whatever else ``--metrics-sink`` names."""


def metrics_sinks(catalog: Any, asked: Iterable[str]) -> tuple[str, ...]:
    """The sinks a run reports to: the run folder's own (:data:`RUN_FOLDER_SINK`), then
    those ``--metrics-sink`` names. Without its plugin, and with others asked for, the
    run goes on with those and says once that its folder will hold no events."""
    asked = tuple(dict.fromkeys(asked))
    kept = any(i.name == RUN_FOLDER_SINK for i in catalog.available("sexpgpu_metrics_sinks"))
    if kept or not asked:  # none asked: refused by name if unavailable, as it always was
        return tuple(dict.fromkeys((RUN_FOLDER_SINK, *asked)))
    from sexpgpu.log import get_logger

    get_logger("sexpgpu.run").warning(
        f"the metrics sink '{RUN_FOLDER_SINK}' is unavailable: this run's folder will hold "
        "no events.jsonl, so `sexpgpu runs`, `report` and `evaluate --follow` see none of "
        f"its numbers, which go to {', '.join(asked)} only"
    )
    return asked


ROOT_OPTIONS = ("--log-format", "--log-level")
"""Options of the root group that are also accepted after the command."""


def hoist_root_options(args: list[str]) -> list[str]:
    """Move ``--log-format``/``--log-level`` (with their values) to the front, so
    ``sexpgpu run X --log-format json`` means ``sexpgpu --log-format json run X``.

    Their order among themselves is kept (the last one wins, as click has it);
    nothing after ``--`` moves.
    """
    front: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(args):
        token = args[index]
        if token == "--":
            rest.extend(args[index:])
            break
        if token.split("=", 1)[0] in ROOT_OPTIONS:
            width = 1 if "=" in token else 2
            front.extend(args[index : index + width])
            index += width
            continue
        rest.append(token)
        index += 1
    return front + rest

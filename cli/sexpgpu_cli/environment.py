"""What ``sexpgpu run`` sets before anything imports torch.

Some libraries read their settings once, when they start (ATen its vector
capability, OpenMP its thread count, MKL its reproducibility branch), so a run
that must take a checkpoint's pinned choices sets them in its environment first:
the lowering the run will take says what (``LoweringInfo.environment``). It is read
without those libraries; errors are left to the run, which reads the checkpoint
again and reports what is wrong in its place, but for a checkpoint location that
cannot be reached, refused at once rather than tried again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from sexpgpu.catalog import Catalog
from sexpgpu.extension import LoweringInfo
from sexpgpu.session import Target, recorded_choices


def prepare_environment(
    catalog: Catalog,
    target: Target,
    *,
    resume: str | None,
    checkpoint_dir: str | None,
) -> dict[str, str]:
    """Set, in ``os.environ``, what the lowering's libraries must start with to take
    this run's pinned choices (a resume's record, the user's requests); returns it."""
    from sexpgpu.errors import SexpError

    recorded = checkpoint_choices(catalog, resume, checkpoint_dir) if resume else None
    if recorded is None and target.bundled is not None:
        recorded = dict(target.bundled)
    try:
        choices = target.choices(None, recorded)
        info = lowering_for(catalog, target, recorded)
        if info is None or info.environment is None:
            return {}
        env = dict(info.environment(choices.pins()))
    except SexpError:
        return {}
    overridden = {k: v for k, v in env.items() if k in os.environ and os.environ[k] != v}
    os.environ.update(env)
    if overridden and recorded is not None and not target.fresh:
        from sexpgpu.log import get_logger

        # This machine's own setting was set aside: say so, the run did move.
        get_logger("sexpgpu.run").info(
            "environment pinned to the checkpoint's choices", **overridden
        )
    return env


def checkpoint_choices(
    catalog: Catalog, resume: str, checkpoint_dir: str | None
) -> dict[str, str] | None:
    """The ``choices`` of the checkpoint ``--resume resume`` names; ``None`` when there
    is none, or when it cannot be read (the run's own read then reports that in its
    place). A location that cannot be reached or listed is refused here, as the run
    would refuse it: its every attempt (seconds of retries, on a dead endpoint) is
    not made twice."""
    from sexpgpu import checkpoint as ckpt
    from sexpgpu.errors import SexpError, StorageError
    from sexpgpu_cli.launch import in_worker

    try:
        found = ckpt.resolve_resume(resume, checkpoint_dir, catalog.open_location)
    except StorageError as error:
        if in_worker() and os.environ.get("RANK", "0") != "0":
            sys.exit(error.exit_code)  # every rank meets it: rank 0 says it, as for the run's
        raise
    except (SexpError, OSError):
        return None
    if found is None:
        return None
    try:
        experiment = ckpt.read_experiment(*found)
    except (SexpError, OSError):
        return None
    return recorded_choices(experiment, catalog)


def lowering_for(
    catalog: Catalog, target: Target, recorded: Mapping[str, str] | None = None
) -> LoweringInfo | None:
    """The lowering a run of ``target`` takes (``--lowering``, a pinned record, else the
    device kind's default), known before anything imports its libraries."""
    from sexpgpu.kernels import choose_lowering, device_kind
    from sexpgpu.plugin_supplies import defaults_of

    lowerings = catalog.lowerings()
    info = choose_lowering(lowerings, device=target.device, choices=target.choices(None, recorded))
    if info is None:
        kind = device_kind(target.device)
        info = next((i for i in lowerings if kind in defaults_of(i)), None)
    return info

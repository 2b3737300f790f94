"""The kernel-choice rule, one for every lowering (no lowering's tensors here).

A program's choice sites (:class:`sexpgpu.graph.ChoiceSite`: ``attention:model.attn``,
``stack:model.blocks``...) each get one kernel (:class:`sexpgpu.extension.KernelInfo`).
A kernel *fits* a site when its ``kind`` is the site's kind, its ``lowering`` is the
lowering choosing, and its ``devices`` include the device's kind (``cuda`` for
``cuda:1``). Among the fitting kernels, only deterministic ones unless the run asks
for non-deterministic execution, the highest ``priority`` wins, then the name in
alphabetical order. A choice recorded by a checkpoint (``pinned``) is taken instead of
the rule; a pinned name that fits nothing here is ``E-CHOICE-001``. The names chosen
are what a trainer records as its ``choices`` (:func:`recorded`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import CheckpointError, PluginError

if TYPE_CHECKING:
    from sexpgpu.extension import KernelInfo
    from sexpgpu.graph import ChoiceSite, Program


def device_kind(device: str) -> str:
    """The kind of a device as kernels and lowerings name it: ``cuda:1`` -> ``cuda``."""
    return device.split(":", 1)[0]


def fitting(kernels: Sequence[KernelInfo], *, lowering: str, device: str) -> list[KernelInfo]:
    """The kernels that ``lowering`` can call on ``device``'s kind, in the given order."""
    kind = device_kind(device)
    return [k for k in kernels if k.lowering == lowering and kind in k.devices]


def rank(kernel: KernelInfo) -> tuple[int, str]:
    """The sort key of the rule: the highest priority first, then the name."""
    return (-kernel.priority, kernel.name)


def choose_kernels(
    program: Program,
    *,
    lowering: str,
    device: str,
    kernels: Sequence[KernelInfo],
    pinned: Mapping[str, str] | None,
) -> dict[str, KernelInfo]:
    """The kernel for every choice site of ``program``, by the rule of this module.

    ``pinned[site]`` takes precedence over the rule (pins for sites the program no
    longer has are ignored). Raises :class:`CheckpointError` ``E-CHOICE-001`` for a
    pinned name that fits nothing here, and :class:`PluginError` for a site that no
    kernel fits.
    """
    here = fitting(kernels, lowering=lowering, device=device)
    deterministic = program.run.deterministic
    chosen: dict[str, KernelInfo] = {}
    for site in program.sites:
        if pinned and site.name in pinned:
            chosen[site.name] = _pinned(site, pinned[site.name], here, lowering, device)
        else:
            chosen[site.name] = _by_rule(site, here, deterministic, lowering, device)
    return chosen


def _pinned(
    site: ChoiceSite, name: str, here: Sequence[KernelInfo], lowering: str, device: str
) -> KernelInfo:
    match = next((k for k in here if k.kind == site.kind and k.name == name), None)
    if match is None:
        raise CheckpointError(
            f"the recorded choice '{name}' for {site.name} cannot be taken here: "
            f"no available {site.kind} kernel '{name}' for the {lowering} lowering on "
            f"{device_kind(device)} (use --choices fresh to choose again)",
            code="E-CHOICE-001",
        )
    return match


def _by_rule(
    site: ChoiceSite,
    here: Sequence[KernelInfo],
    deterministic: bool,
    lowering: str,
    device: str,
) -> KernelInfo:
    candidates = [k for k in here if k.kind == site.kind and (k.deterministic or not deterministic)]
    if not candidates:
        wanted = "deterministic " if deterministic else ""
        raise PluginError(
            f"no {wanted}{site.kind} kernel for the {lowering} lowering on "
            f"{device_kind(device)} (needed by {site.name}; see `sexpgpu plugins`)",
            pos=site.pos,
        )
    return min(candidates, key=rank)


def recorded(chosen: Mapping[str, KernelInfo]) -> dict[str, str]:
    """``{site: kernel name}``: what a trainer exposes as ``choices`` and a checkpoint
    records, so that a resume can pin the same kernels."""
    return {site: kernel.name for site, kernel in chosen.items()}


# ---------------------------------------------------------------- the lowering itself

LOWERING_CHOICE = "lowering"
"""The recorded choice naming the lowering a run used (``torch``, ``compiled``)."""

UNRECORDED_LOWERING = "torch"
"""What a checkpoint that records no lowering ran on: the eager torch lowering, the
only one there was before the choice was recorded."""


def with_lowering(recorded: Mapping[str, str]) -> dict[str, str]:
    """A checkpoint's recorded choices with ``lowering`` as it ran: the eager one when
    the checkpoint is older than the record."""
    return {LOWERING_CHOICE: UNRECORDED_LOWERING, **recorded}


def choose_lowering(
    lowerings: Sequence[Any],
    *,
    device: str,
    requested: str | None,
    pinned: Mapping[str, str] | None,
) -> Any:
    """The :class:`sexpgpu.extension.LoweringInfo` named for a run on ``device``, or
    ``None`` when none is: the run then takes the default for the device kind
    (``LoweringInfo.default_for``).

    ``requested`` (``--lowering``) names one; else the pinned choice ``lowering``
    of a resume. ``requested`` against another pinned lowering, or a pinned
    one that cannot serve here, is ``E-CHOICE-001``; a requested one that is not
    installed or does not serve the device is a :class:`PluginError`. Conflicts
    are the plugin machinery's: a contested descriptor comes in refusing.
    """
    kind = device_kind(device)
    recorded_name = (pinned or {}).get(LOWERING_CHOICE)
    if requested and recorded_name and requested != recorded_name:
        raise CheckpointError(
            f"the recorded choice '{recorded_name}' for {LOWERING_CHOICE} cannot be taken "
            f"with --lowering {requested} (use --choices fresh to choose again)",
            code="E-CHOICE-001",
        )
    name = requested or recorded_name
    if name is None:
        return None
    found = next((info for info in lowerings if info.name == name), None)
    if found is not None and kind in found.devices:
        return found
    if requested is None:
        why = "no such lowering is installed" if found is None else f"it does not run on {kind}"
        raise CheckpointError(
            f"the recorded choice '{name}' for {LOWERING_CHOICE} cannot be taken here: "
            f"{why} (use --choices fresh to choose again)",
            code="E-CHOICE-001",
        )
    serving = sorted(info.name for info in lowerings if kind in info.devices)
    if found is None:
        raise PluginError(
            f"--lowering {name}: no installed plugin supplies that lowering "
            f"(lowerings for {kind}: {', '.join(serving) or 'none'}; see `sexpgpu plugins`)"
        )
    raise PluginError(
        f"--lowering {name}: the {name} lowering does not run on {kind} "
        f"(it runs on {', '.join(found.devices)})"
    )

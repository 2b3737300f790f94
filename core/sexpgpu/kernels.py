"""The kernel-choice rule, one for every lowering (no lowering's tensors here).

A program's choice sites (:class:`sexpgpu.lang.ir.ChoiceSite`: ``attention:model.attn``,
``stack:model.blocks``...) each get one kernel (:class:`sexpgpu.extension.KernelInfo`).
A kernel *fits* a site when its ``kind`` is the site's kind, its ``lowering`` is the
lowering choosing, and its ``devices`` include the device's kind (``cuda`` for
``cuda:1``). Among the fitting kernels, only deterministic ones unless the run asks
for non-deterministic execution, the highest ``priority`` wins, then the name in
alphabetical order. A choice the run's :class:`sexpgpu.choices.Choices` pins (a
resume's record, or the user's ``--choose``) is taken instead of the rule: a
recorded name that fits nothing here is ``E-CHOICE-001``; a requested one must fit,
and be deterministic in a deterministic run. The names chosen are what a trainer
records as its ``choices`` (:func:`recorded`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sexpgpu.choices import LOWERING_CHOICE, Choices, cannot_take
from sexpgpu.errors import PluginError

if TYPE_CHECKING:
    from sexpgpu.extension import KernelInfo
    from sexpgpu.lang.ir import ChoiceSite, Program


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
    choices: Choices,
) -> dict[str, KernelInfo]:
    """The kernel for every choice site of ``program``, by the rule of this module.

    A site ``choices`` pins takes its pinned kernel instead of the rule (pins for
    sites the program no longer has are ignored). Raises :class:`CheckpointError`
    ``E-CHOICE-001`` for a recorded name that fits nothing here, and
    :class:`PluginError` for a site that no kernel fits, or for a request that fits
    nothing here or is not deterministic in a deterministic run (naming the request
    and the kernels that fit).
    """
    here = fitting(kernels, lowering=lowering, device=device)
    deterministic = program.run.deterministic
    where = f"for the {lowering} lowering on {device_kind(device)}"
    chosen: dict[str, KernelInfo] = {}
    for site in program.sites:
        pin = choices.pin(site.name)
        if pin is not None and choices.is_request(site.name):
            asked = choices.words(site.name)
            chosen[site.name] = _requested(site, pin, asked, here, deterministic, where)
        elif pin is not None:
            chosen[site.name] = _pinned(site, pin, here, where)
        else:
            chosen[site.name] = _by_rule(site, here, deterministic, where)
    return chosen


def _pinned(site: ChoiceSite, name: str, here: Sequence[KernelInfo], where: str) -> KernelInfo:
    match = next((k for k in here if k.kind == site.kind and k.name == name), None)
    if match is None:
        raise cannot_take(site.name, name, f"no available {site.kind} kernel '{name}' {where}")
    return match


def _requested(
    site: ChoiceSite,
    name: str,
    asked: str,
    here: Sequence[KernelInfo],
    deterministic: bool,
    where: str,
) -> KernelInfo:
    of_kind = [k for k in here if k.kind == site.kind]
    match = next((k for k in of_kind if k.name == name), None)
    if match is None:
        # the ones this run can take first, each part by the rule's order
        of_kind.sort(key=lambda k: (deterministic and not k.deterministic, rank(k)))
        listed = ", ".join(
            k.name + ("" if k.deterministic or not deterministic else " (not deterministic)")
            for k in of_kind
        )
        raise PluginError(
            f"{asked}: no {site.kind} kernel '{name}' {where} "
            f"(kernels that fit: {listed or 'none'}; see `sexpgpu check`)"
        )
    if deterministic and not match.deterministic:
        raise PluginError(
            f"{asked}: the {site.kind} kernel '{name}' is not deterministic and this run is "
            "(add :deterministic false to its defrun to take it)"
        )
    return match


def _by_rule(
    site: ChoiceSite, here: Sequence[KernelInfo], deterministic: bool, where: str
) -> KernelInfo:
    candidates = [k for k in here if k.kind == site.kind and (k.deterministic or not deterministic)]
    if not candidates:
        wanted = "deterministic " if deterministic else ""
        raise PluginError(
            f"no {wanted}{site.kind} kernel {where} (needed by {site.name}; see `sexpgpu plugins`)",
            pos=site.pos,
        )
    return min(candidates, key=rank)


def recorded(chosen: Mapping[str, KernelInfo]) -> dict[str, str]:
    """``{site: kernel name}``: what a trainer exposes as ``choices`` and a checkpoint
    records, so that a resume can pin the same kernels."""
    return {site: kernel.name for site, kernel in chosen.items()}


def choose_lowering(lowerings: Sequence[Any], *, device: str, choices: Choices) -> Any:
    """The :class:`sexpgpu.extension.LoweringInfo` ``choices`` names for a run on
    ``device`` (``--lowering``, else a resume's pinned record), or ``None`` when none
    is named: the run then takes the default for the device kind
    (``LoweringInfo.default_for``).

    A pinned one that cannot serve here is ``E-CHOICE-001``; a requested one that is
    not installed or does not serve the device is a :class:`PluginError`. Conflicts
    are the catalog's: a contested descriptor comes in refusing.
    """
    kind = device_kind(device)
    name = choices.lowering()
    if name is None:
        return None
    found = next((info for info in lowerings if info.name == name), None)
    if found is not None and kind in found.devices:
        return found
    if not choices.is_request(LOWERING_CHOICE):
        why = "no such lowering is installed" if found is None else f"it does not run on {kind}"
        raise cannot_take(LOWERING_CHOICE, name, why)
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

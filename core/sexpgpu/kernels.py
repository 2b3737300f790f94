"""The kernel-choice rule, one for every lowering (no lowering's tensors here), and
the choice of a lowering: docs/plugins.md states both (its "Writing a kernel" and
"sexpgpu_lowerings")."""

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
    """The kernel for every choice site of ``program``: its pinned one, else by the rule
    (pins for sites the program no longer has are ignored)."""
    here = fitting(kernels, lowering=lowering, device=device)
    deterministic = program.run.deterministic
    where = f"for the {lowering} lowering on {device_kind(device)}"
    chosen: dict[str, KernelInfo] = {}
    for site in program.sites:
        of_kind = [k for k in here if k.kind == site.kind]
        pin = choices.pin(site.name)
        match = next((k for k in of_kind if k.name == pin), None)
        if pin is None:
            match = _by_rule(site, of_kind, deterministic, where)
        elif choices.is_request(site.name):
            asked = choices.words(site.name)
            _check_request(site, pin, asked, match, of_kind, deterministic, where)
        elif match is None:
            raise cannot_take(site.name, pin, f"no available {site.kind} kernel '{pin}' {where}")
        chosen[site.name] = match
    return chosen


def _check_request(
    site: ChoiceSite,
    name: str,
    asked: str,
    match: KernelInfo | None,
    of_kind: list[KernelInfo],
    deterministic: bool,
    where: str,
) -> None:
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


def _by_rule(
    site: ChoiceSite, of_kind: list[KernelInfo], deterministic: bool, where: str
) -> KernelInfo:
    candidates = [k for k in of_kind if k.deterministic or not deterministic]
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
    ``device``, or ``None`` when none is named (the run takes the device's default).
    A contested descriptor comes in refusing, from the catalog."""
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

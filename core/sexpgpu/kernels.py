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

A user asks for kernels with ``sexpgpu run --choose SITE=KERNEL`` (a site's full name,
or a kind for every site of that kind; :func:`parse_requests`). The core resolves the
requests against the program and the recorded choices (:func:`pin_requests`) and hands
them to the lowering inside ``pinned`` (a :class:`Pins`), so a lowering that passes
``pinned`` on to :func:`choose_kernels` as it came takes them with no change of its own;
the rule then checks each request as one: it must fit, and be deterministic in a
deterministic run.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import CheckpointError, PluginError, UsageError

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
    kernel fits. A pin the user asked for (``pinned.requested``, see :class:`Pins`)
    that fits nothing here, or is not deterministic in a deterministic run, is a
    :class:`PluginError` naming the request and the kernels that fit.
    """
    here = fitting(kernels, lowering=lowering, device=device)
    deterministic = program.run.deterministic
    requested: Mapping[str, str] = getattr(pinned, "requested", {})
    chosen: dict[str, KernelInfo] = {}
    for site in program.sites:
        if pinned and site.name in requested:
            chosen[site.name] = _requested(
                site, pinned[site.name], requested[site.name], here, deterministic, lowering, device
            )
        elif pinned and site.name in pinned:
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


def _requested(
    site: ChoiceSite,
    name: str,
    asked: str,
    here: Sequence[KernelInfo],
    deterministic: bool,
    lowering: str,
    device: str,
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
            f"{asked}: no {site.kind} kernel '{name}' for the {lowering} lowering on "
            f"{device_kind(device)} (kernels that fit: {listed or 'none'}; see `sexpgpu check`)"
        )
    if deterministic and not match.deterministic:
        raise PluginError(
            f"{asked}: the {site.kind} kernel '{name}' is not deterministic and this run is "
            "(add :deterministic false to its defrun to take it)"
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


# ---------------------------------------------------------------- the user's requests

CHOOSE = "--choose"

# Recorded choices that are not kernel sites, and the option that sets each instead.
_OTHER_OPTIONS = {"lowering": "--lowering", "cpu.threads": "--threads"}


class Pins(dict[str, str]):
    """``pinned`` as a lowering receives it: site -> kernel name, a resume's recorded
    choices and the user's requests together. ``requested`` maps each site a request
    pins to the request as the user wrote it (``--choose attention=sdpa``), so that
    :func:`choose_kernels` checks those as requests. A lowering passes it on to
    :func:`choose_kernels` as it came (a plain copy keeps the pins, not the checks)."""

    def __init__(self, pins: Mapping[str, str], requested: Mapping[str, str]) -> None:
        super().__init__(pins)
        self.requested: dict[str, str] = dict(requested)


def parse_requests(values: Iterable[str]) -> dict[str, str]:
    """``("attention=sdpa", "stack:model.blocks=looped")`` -> ``{target: kernel}``, as
    ``--choose`` takes them; a target given twice takes its last kernel (as ``--set``).
    Raises :class:`UsageError` for an item that is not ``SITE=KERNEL``."""
    requests: dict[str, str] = {}
    for item in values:
        target, sep, kernel = item.partition("=")
        if not sep or not target.strip() or not kernel.strip():
            raise UsageError(f"{CHOOSE} takes SITE=KERNEL or KIND=KERNEL, got '{item}'")
        requests[target.strip()] = kernel.strip()
    return requests


def requested_sites(program: Program, requests: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{site: (kernel, target)}`` for ``requests`` (``{target: kernel}``): a target
    that is a kind names every site of that kind, and a site's full name wins over
    its kind. Raises :class:`UsageError` for a target the program has neither as a
    site nor as a kind."""
    names = {site.name for site in program.sites}
    kinds = sorted({site.kind for site in program.sites})
    for target, kernel in requests.items():
        if target not in names and target not in kinds:
            raise UsageError(_unknown_target(program, target, kernel, kinds))
    wanted: dict[str, tuple[str, str]] = {}
    for site in program.sites:
        target = site.name if site.name in requests else site.kind
        if target in requests:
            wanted[site.name] = (requests[target], target)
    return wanted


def _unknown_target(program: Program, target: str, kernel: str, kinds: list[str]) -> str:
    asked = f"{CHOOSE} {target}={kernel}"
    if target in _OTHER_OPTIONS:
        return f"{asked}: {target} is not a kernel choice site; use {_OTHER_OPTIONS[target]}"
    sites = [site.name for site in program.sites]
    near = difflib.get_close_matches(target, sites + kinds, n=1)
    hint = f"did you mean '{near[0]}'? " if near else ""
    listed = f"its sites: {', '.join(sites)}; kinds: {', '.join(kinds)}" if sites else "it has none"
    return f"{asked}: the program has no choice site or kind '{target}' ({hint}{listed})"


def pin_requests(
    program: Program, requests: Mapping[str, str] | None, pinned: Mapping[str, str] | None
) -> Mapping[str, str] | None:
    """``pinned`` with the user's ``requests`` (``{target: kernel}``, see
    :func:`requested_sites`) added, as a :class:`Pins`; ``pinned`` itself without any.

    A request against another kernel that ``pinned`` records for its site (a pinned
    resume) is ``E-CHOICE-001``, as ``--lowering`` against a recorded lowering is; one
    that asks for the recorded kernel is the recorded pin. A resume with
    ``--choices fresh`` pins no kernel, so its requests stand.
    """
    if not requests:
        return pinned
    pins = dict(pinned or {})
    asked: dict[str, str] = {}
    for site, (kernel, target) in requested_sites(program, requests).items():
        old = pins.get(site)
        if old is not None and old != kernel:
            raise CheckpointError(
                f"the recorded choice '{old}' for {site} cannot be taken with "
                f"{CHOOSE} {target}={kernel} (use --choices fresh to choose again)",
                code="E-CHOICE-001",
            )
        if old is None:
            pins[site] = kernel
            asked[site] = f"{CHOOSE} {target}={kernel}"
    return Pins(pins, asked)


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

"""The choices a run makes (anything a lowering decides that changes a run's bits),
as one typed record: what the user asked for, what the checkpoint it continues
recorded, and whether those are taken. The names are the lowering's; the core keeps
only the rule (docs/determinism.md, "Pinning a run to recorded choices")."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sexpgpu.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from sexpgpu.lang.ir import Program

E_CHOICE = "E-CHOICE-001"
"""A recorded choice that cannot be taken here, or a request against one."""

LOWERING_CHOICE = "lowering"
"""The recorded choice naming the lowering a run used (``torch``, ``compiled``)."""

SHARD_CHOICE = "shard"
"""The recorded choice of what a run's devices shard (``none``, ``optimizer``, ``full``)."""

FRESH_HINT = "use --choices fresh to choose again"

CHOOSE = "--choose"


@dataclass(frozen=True)
class Choices:
    """The choices a run is opened with: ``requested`` values with the words ``asked``
    (``--choose attention=sdpa``), and the checkpoint's ``recorded`` ones, taken when
    ``pinned``. Build one with :meth:`make`."""

    requested: Mapping[str, str] = field(default_factory=dict)
    asked: Mapping[str, str] = field(default_factory=dict)
    recorded: Mapping[str, str] = field(default_factory=dict)
    pinned: bool = True

    @classmethod
    def make(
        cls,
        *,
        requested: Mapping[str, str] | None = None,
        asked: Mapping[str, str] | None = None,
        recorded: Mapping[str, str] | None = None,
        fresh: bool = False,
    ) -> Choices:
        """The choices of a run; raises :class:`CheckpointError` ``E-CHOICE-001`` for a
        request that differs from the value a pinned checkpoint recorded. A request
        for the recorded value is the recorded pin, not a request."""
        requested, asked = dict(requested or {}), dict(asked or {})
        recorded = {str(k): str(v) for k, v in (recorded or {}).items()}
        if not fresh:
            for name in sorted(requested.keys() & recorded.keys()):
                old = recorded[name]
                if old != requested[name]:
                    raise CheckpointError(
                        f"the recorded choice '{old}' for {name} cannot be taken with "
                        f"{asked.get(name, name)} ({FRESH_HINT})",
                        code=E_CHOICE,
                    )
                del requested[name]
                asked.pop(name, None)
        return cls(requested=requested, asked=asked, recorded=recorded, pinned=not fresh)

    def pin(self, name: str) -> str | None:
        """The value a lowering must take for ``name``: the user's request, else the
        pinned recorded value; ``None`` to choose by its own rule."""
        return self.pins().get(name)

    def pins(self) -> dict[str, str]:
        """Every value a lowering must take, by choice."""
        return {**(self.recorded if self.pinned else {}), **self.requested}

    def is_request(self, name: str) -> bool:
        """Whether the value of ``name`` is the user's request (which must fit here)."""
        return name in self.requested

    def words(self, name: str) -> str:
        """The request for ``name`` as the user wrote it."""
        return self.asked.get(name, f"{name}={self.requested.get(name)}")

    def lowering(self) -> str | None:
        """The lowering asked for or pinned, by name; ``None`` for the device's default."""
        return self.pin(LOWERING_CHOICE)

    def moved(self, made: Mapping[str, str]) -> list[str]:
        """``choice <name> <old> -> <new>`` for each recorded choice ``made`` changed."""
        old = self.recorded
        return [
            f"choice {name} {old[name]} -> {value}"
            for name, value in sorted(made.items())
            if old.get(name, value) != value
        ]


class ChoiceRefused(CheckpointError):
    """``E-CHOICE-001`` for a pinned ``value`` of ``choice`` that cannot be taken here."""

    def __init__(self, choice: str, value: str, why: str) -> None:
        self.choice, self.value, self.why = choice, value, why
        said = f"the recorded choice '{value}' for {choice} cannot be taken here: {why}"
        super().__init__(f"{said} ({FRESH_HINT})", code=E_CHOICE)


cannot_take = ChoiceRefused  # the name lowerings raise it by


# ---------------------------------------------------------------- --choose


def kernel_requests(
    program: Program, requests: Mapping[str, str], other_options: Mapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """``--choose`` requests (``{target: kernel}``, docs/run.md) as (``{site: kernel}``,
    ``{site: the words}``) for :meth:`Choices.make`; ``other_options`` maps a recorded
    choice to the option that sets it (``{"cpu.threads": "--threads"}``)."""
    sites = [site.name for site in program.sites]
    kinds = sorted({site.kind for site in program.sites})
    others = {LOWERING_CHOICE: "--lowering", **(other_options or {})}
    for target, kernel in requests.items():
        if target in sites or target in kinds:
            continue
        asked = f"{CHOOSE} {target}={kernel}"
        if target in others:
            raise UsageError(f"{asked}: {target} is not a kernel choice site; use {others[target]}")
        near = difflib.get_close_matches(target, sites + kinds, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        listed = (
            f"its sites: {', '.join(sites)}; kinds: {', '.join(kinds)}" if sites else "it has none"
        )
        raise UsageError(
            f"{asked}: the program has no choice site or kind '{target}' ({hint}{listed})"
        )
    kernels, words = {}, {}
    for site in program.sites:
        target = site.name if site.name in requests else site.kind
        if target in requests:
            kernels[site.name] = requests[target]
            words[site.name] = f"{CHOOSE} {target}={requests[target]}"
    return kernels, words

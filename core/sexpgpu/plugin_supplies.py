"""What plugins supply, in one table: per hook, the names two plugins must not both
supply. A conflict is never settled by load order: the contested thing is refused
(``E-PLUGIN-001``); everything else those plugins supply keeps working."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import PluginError

CONFLICT_CODE = "E-PLUGIN-001"
DISABLE_PLUGINS = "SEXPGPU_DISABLE_PLUGINS"
PROJECT_DISTRIBUTION = "sexpgpu"


def defaults_of(info: Any) -> tuple[str, ...]:
    """The device kinds a lowering is the default for (``default_for``, else ``devices``)."""
    return tuple(info.devices if info.default_for is None else info.default_for)


def _lowering_keys(info: Any) -> tuple[str, ...]:
    # Serving a kind is no claim: only being its default is, since a run without
    # --lowering must find one lowering for its device, never settle it by load order.
    return (
        f"lowering '{info.name}'",
        *(f"lowering for '{device}' devices" for device in defaults_of(info)),
    )


BUILT_IN = "<core>"
"""The claimant named for the language's built-in ops in a conflict."""


def _op_keys(info: Any) -> tuple[str, ...]:
    from sexpgpu.lang.contracts import op_claims

    return op_claims(info)


def _built_in_claims(hook: str) -> list[tuple[str, str, str]]:
    """(key, claimant, where) for what the core itself supplies through ``hook``."""
    if hook != "sexpgpu_ops":
        return []
    from sexpgpu.lang.contracts import built_in_op_claims

    return [(key, BUILT_IN, f"{PROJECT_DISTRIBUTION} built-in") for key in built_in_op_claims()]


SUPPLIES: dict[str, Callable[[Any], tuple[str, ...]]] = {
    "sexpgpu_lowerings": _lowering_keys,
    "sexpgpu_kernels": lambda i: (f"{i.kind} kernel '{i.name}' of the {i.lowering} lowering",),
    "sexpgpu_ops": _op_keys,
    "sexpgpu_optimizers": lambda i: (f"optimizer '{i.name}'",),
    "sexpgpu_storage_backends": lambda i: tuple(f"storage scheme '{s}'" for s in i.schemes),
    "sexpgpu_metrics_sinks": lambda i: (f"metrics sink '{i.name}'",),
    "sexpgpu_data_sources": lambda i: (f"data source '{i.name}'",),
    # one runner serves every pass: any two plugins supplying one conflict
    "sexpgpu_evaluators": lambda i: ("eval-pass runner",),
    "sexpgpu_eval_metrics": lambda i: (f"eval metric '{i.name}'",),
    "sexpgpu_source_openers": lambda i: (f"source files '*{i.suffix}'",),
    "sexpgpu_run_options": lambda i: (f"run option '{i.flag}'",),
}
"""Every hook that supplies descriptors, with the phrases naming what a descriptor
claims (``storage scheme 'file'``). Commands are keyed where the CLI adds them."""

COMMANDS_HOOK = "sexpgpu_cli_commands"


@dataclass(frozen=True)
class Conflict:
    """One thing (``what``: ``storage scheme 'file'``) supplied by more than one available
    plugin; ``owners`` are they, as (entry-point name, ``distribution version``)."""

    hook: str
    what: str
    owners: tuple[tuple[str, str], ...]

    @property
    def plugins(self) -> list[str]:
        """The entry-point names of the plugins in conflict."""
        return [name for name, _ in self.owners]

    def message(self, what: str | None = None) -> str:
        """The one-line refusal, for ``what`` (default: the conflict's own phrase)."""
        return conflict_message(what or f"the {self.what}", self.owners)

    def error(self, what: str | None = None) -> PluginError:
        """The :class:`PluginError` raised when the contested thing is used."""
        return PluginError(self.message(what), code=CONFLICT_CODE)

    def as_json(self) -> dict[str, Any]:
        """The conflict as ``sexpgpu plugins --json`` prints it."""
        return {"what": self.what, "hook": self.hook, "plugins": self.plugins}


def conflict_message(what: str, owners: Sequence[tuple[str, str]]) -> str:
    """``E-PLUGIN-001: <what> is supplied by more than one plugin: ...; disable ...``,
    keeping sexpgpu's own plugin when it is one of them (a third party taking over a
    built-in is the usual case), else the first."""
    named = [owner_text(name, where) for name, where in owners]
    listed = ", ".join(named[:-1]) + f" and {named[-1]}"
    keep = next((name for name, where in owners if _ours(where)), owners[0][0])
    others = ",".join(name for name, _ in owners if name != keep)
    return (
        f"{CONFLICT_CODE}: {what} is supplied by more than one plugin: {listed}; "
        f"disable all but one, e.g. {DISABLE_PLUGINS}={others}"
    )


def owner_text(name: str, where: str) -> str:
    """A plugin as a conflict names it: ``'x' (dist 1.0)``, ``'eval' (sexpgpu's own
    plugin)``, or the core itself for the language's built-in ops."""
    if name == BUILT_IN:
        return "sexpgpu's built-in ops"
    return f"'{name}' (sexpgpu's own plugin)" if _ours(where) else f"'{name}' ({where})"


def _ours(where: str) -> bool:
    return where.split(" ")[0] == PROJECT_DISTRIBUTION


def find_conflicts(hook: str, claims: Iterable[tuple[Any, str, str]]) -> list[Conflict]:
    """The conflicts among ``claims`` (descriptor, plugin name, ``dist version``) of
    ``hook``; one plugin's claims never conflict with each other."""
    owners: dict[str, dict[str, str]] = {}
    for key, name, where in _built_in_claims(hook):
        owners.setdefault(key, {})[name] = where
    for info, name, where in claims:
        for key in _keys(hook, info):
            owners.setdefault(key, {}).setdefault(name, where)
    return [
        Conflict(hook, key, tuple(found.items())) for key, found in owners.items() if len(found) > 1
    ]


def _keys(hook: str, info: Any) -> tuple[str, ...]:
    try:
        return SUPPLIES[hook](info) if hook in SUPPLIES else ()
    except Exception:  # a malformed descriptor claims nothing; using it fails on its own
        return ()


def contested_keys(hook: str, info: Any, conflicts: Iterable[Conflict]) -> list[Conflict]:
    """The conflicts among ``conflicts`` that ``info`` (a descriptor of ``hook``) is part of."""
    keys = set(_keys(hook, info))
    return [c for c in conflicts if c.hook == hook and c.what in keys]


def refusing(info: Any, conflict: Conflict) -> Any:
    """A copy of descriptor ``info`` whose callables raise the conflict's error, handed
    out in place of a contested one: a lowering choosing among kernels fails with the
    conflict only if it uses the contested one."""
    if not dataclasses.is_dataclass(info) or isinstance(info, type):
        return info

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise conflict.error()

    changes: dict[str, Any] = {}
    for spec in dataclasses.fields(info):
        value = getattr(info, spec.name)
        if callable(value):
            changes[spec.name] = refuse
        elif isinstance(value, Mapping) and value and all(callable(v) for v in value.values()):
            changes[spec.name] = {key: refuse for key in value}
    return dataclasses.replace(info, **changes)


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The name in ``known`` closest to ``name``, if any is close."""
    found = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return found[0] if found else None


def exception_text(exc: BaseException) -> str:
    """An exception as one line keeping all of it: lines joined with `` | ``, each
    cause after ``; caused by <Type>: <message>``."""
    parts = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        lines = [line.strip() for line in str(current).splitlines() if line.strip()]
        parts.append(type(current).__name__ + (": " + " | ".join(lines) if lines else ""))
        suppressed = current.__suppress_context__
        current = current.__cause__ or (None if suppressed else current.__context__)
    return "; caused by ".join(parts)

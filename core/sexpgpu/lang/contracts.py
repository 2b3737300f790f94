"""What a plugin must declare for sexpgpu to use it, checked when the catalog first asks
the plugin: each hook's answer against the type the hook declares it returns
(:mod:`sexpgpu.hookspecs`), then each descriptor against its contract here. A plugin
that breaks one is refused, with the reason, in ``sexpgpu plugins`` and in the error
of a program that uses it; every other plugin keeps working.

Only what can be told from the descriptor alone is here. What depends on a program
(an op's output on the program's shapes, an optimizer's states on its parameters)
is checked when the program is lowered, by the lowering.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sexpgpu import hookspecs
from sexpgpu.errors import SexpError
from sexpgpu.lang.ops import BUILTINS, STRUCTURAL, OpSpec
from sexpgpu.lang.reader import read

__all__ = [
    "CONTRACTS",
    "HOOK_NAMES",
    "WORD",
    "broken",
    "built_in_op_claims",
    "held_to_contract",
    "hook_mistakes",
    "op_claims",
]

HOOK_NAMES = frozenset(
    name for name, obj in vars(hookspecs).items() if hasattr(obj, f"{hookspecs.PROJECT}_spec")
)
"""Every hook a plugin may implement."""

WORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
"""A name a plugin gives what a `.sx` file writes (an option after ``:``, an op, an
optimizer): a letter, then letters, digits, ``-`` and ``_``, as the language's own
names are. The reader would take more, but a space, a bracket, a quote or ``;`` ends
a word, and ``/`` and ``.`` already join a parameter's path and its states."""

WORD_TEXT = "a name is a letter, then letters, digits, '-' or '_'"

# ---------------------------------------------------------------- hooks


def hook_mistakes(plugin: Any, implemented: dict[str, bool]) -> list[str]:
    """Warnings for functions of ``plugin`` that look like hooks but are never called
    (``implemented``: each function pluggy took, and whether it is a hook): an unknown
    hook name (with the nearest one) or a hook function not marked ``@hookimpl``."""
    names = set(implemented)
    if isinstance(plugin, types.ModuleType):
        names |= {
            name
            for name, obj in vars(plugin).items()
            if name.startswith("sexpgpu_") and inspect.isfunction(obj)
        }
    warnings = []
    for name in sorted(names):
        if name in HOOK_NAMES and name in implemented:
            continue
        if name in HOOK_NAMES:
            warnings.append(f"{name} is not marked with @hookimpl, so it is never called")
            continue
        close = difflib.get_close_matches(name, sorted(HOOK_NAMES), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"{name} is not a sexpgpu hook, so it is never called{hint}")
    return warnings


def held_to_contract(hook: str, answer: Any) -> tuple[Any, str | None]:
    """What of ``answer``, one plugin's result of ``hook`` (``None`` when it returned
    nothing), fits the type the hook declares, and why the plugin is refused (``None``:
    it is not): an answer of another type, or a descriptor that breaks its contract
    (:data:`CONTRACTS`; such a descriptor is kept, so that using it names the reason).
    A duck-typed stand-in comes back as the descriptor it stands in for."""
    fitting, problem = _held_to_declaration(hook, answer)
    declared = _declared(hook)
    if typing.get_origin(declared) is not list:
        return fitting, problem
    fitting = [_as_declared(value, typing.get_args(declared)[0]) for value in fitting]
    return fitting, problem or next(filter(None, (broken(hook, item) for item in fitting)), None)


def _declared(hook: str) -> Any:
    return getattr(hookspecs, hook).__annotations__.get("return")


def _held_to_declaration(hook: str, answer: Any) -> tuple[Any, str | None]:
    """What of ``answer`` fits the type ``hook`` declares, and why the rest does not.
    One descriptor where a list of them is declared is kept as a list of one; a list's
    items that fit are kept; otherwise nothing is."""
    declared = _declared(hook)
    if _fits(answer, declared):
        return answer, None
    wanted = _type_text(declared)
    if typing.get_origin(declared) is not list:
        return None, f"its {hook} returned {_value_text(answer)}, where it returns {wanted}"
    (item,) = typing.get_args(declared)
    if _fits(answer, item):
        return [answer], f"its {hook} returned one {type(answer).__name__}, not {wanted}"
    if not isinstance(answer, (list, tuple)):
        return [], f"its {hook} returned {_value_text(answer)}, where it returns {wanted}"
    kept = [value for value in answer if _fits(value, item)]
    misfits = [value for value in answer if not _fits(value, item)]
    if not misfits:
        return kept, f"its {hook} returned {_value_text(answer)}, where it returns {wanted}"
    shown = ", ".join(_value_text(value) for value in misfits[:3])
    return kept, f"its {hook} returned a list holding {shown}, where it returns {wanted}"


def _fits(value: Any, declared: Any) -> bool:
    if declared is None or declared is type(None):
        return value is None
    alternatives = typing.get_args(declared)
    if typing.get_origin(declared) is list:
        return isinstance(value, list) and all(_fits(v, alternatives[0]) for v in value)
    if alternatives:  # a union
        return any(_fits(value, alternative) for alternative in alternatives)
    return isinstance(value, declared) or _stands_in(value, declared)


def _stands_in(value: Any, declared: type) -> bool:
    """Whether ``value`` is a duck-typed stand-in for the descriptor class ``declared``:
    no dataclass of another kind, with every field that ``declared`` requires."""
    if not dataclasses.is_dataclass(declared) or dataclasses.is_dataclass(value):
        return False
    required = [
        f.name
        for f in dataclasses.fields(declared)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    return all(hasattr(value, name) for name in required)


def _as_declared(value: Any, declared: type) -> Any:
    """``value`` as a ``declared`` descriptor, the optional fields a stand-in lacks at their
    defaults: read once here, where the plugin hands it over, and never asked again."""
    if isinstance(value, declared):
        return value
    fields = dataclasses.fields(declared)  # type: ignore[arg-type]
    return declared(**{f.name: getattr(value, f.name) for f in fields if hasattr(value, f.name)})


def _type_text(declared: Any) -> str:
    if declared is None or declared is type(None):
        return "None"
    if typing.get_origin(declared) is list:
        return f"a list of {_type_text(typing.get_args(declared)[0])}"
    if isinstance(declared, types.UnionType):
        return " or ".join(_type_text(alternative) for alternative in typing.get_args(declared))
    return getattr(declared, "__name__", str(declared))


def _value_text(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (str, int, float)):
        return f"{type(value).__name__} {value!r:.40}"
    return f"a {type(value).__name__}"


# ---------------------------------------------------------------- each descriptor


def _unwritable(names: Iterable[Any]) -> list[str]:
    return [repr(name) for name in names if not isinstance(name, str) or not WORD.fullmatch(name)]


def _named(what: str, info: Any) -> str | None:
    """Why the name of descriptor ``info`` (``what``: ``optimizer``) cannot be written."""
    if _unwritable([info.name]):
        return f"its {what} {info.name!r} has a name no .sx file can write ({WORD_TEXT})"
    return None


def _options(who: str, options: Any, reserved: tuple[str, ...] = ()) -> str | None:
    """Why ``options`` (name -> default), which ``who`` declares, cannot all be written
    in a `.sx` file as ``:name value``, or ``None``."""
    if not isinstance(options, Mapping):
        return (
            f"{who} declares its options as {_value_text(options)}, not a name -> default mapping"
        )
    bad = _unwritable(options)
    if bad:
        return f"{who} declares options no .sx file can write: {', '.join(bad)} ({WORD_TEXT})"
    written: dict[str, str] = {}
    for name, default in options.items():
        key = name.replace("_", "-")  # how a .sx file writes it (declarations.declared_option)
        if key in reserved:
            return f"{who} declares the option '{name}', which no .sx file can set (:{key} is sexpgpu's)"
        if key in written:
            return f"{who} declares the options '{written[key]}' and '{name}', both written :{key}"
        written[key] = name
        if not _language_value(default):
            return (
                f"{who}: its option '{name}' defaults to {_value_text(default)}, which is no "
                "value of the language (a number, true/false, a string, a list of words, None)"
            )
    return None


def _language_value(value: Any) -> bool:
    """Whether a `.sx` file can write ``value`` as an option's value (``None``: the
    option has no default and must be given, or takes any value)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return not _unwritable(value)
    return value is None or isinstance(value, (bool, int, str))


def _eval_metric(info: Any) -> str | None:
    try:
        forms = read(info.expression, f"<metric {info.name}>")
    except SexpError as exc:
        return f"its eval metric '{info.name}' does not parse: {exc.render()}"
    if len(forms) != 1:
        return f"its eval metric '{info.name}' is {len(forms)} expressions, not one"
    return _named("eval metric", info)


def _op(info: Any) -> str | None:
    spec = info.spec
    if not isinstance(spec, OpSpec):
        return f"its op '{info.name}' has no OpSpec"
    if BUILTINS.get(spec.name) is spec:
        return None  # a lowering's implementation of a built-in op
    if spec.name in STRUCTURAL:
        return f"it supplies an op '{spec.name}', a name the IR keeps"
    if spec.node and spec.infer is None and spec.compile is None:
        return f"it supplies the op '{spec.name}' without an infer"
    bad = _unwritable(spec.surfaces)
    if bad:
        return f"its op '{spec.name}' is called {', '.join(bad)}, which no .sx file can write ({WORD_TEXT})"
    return _options(f"its op '{spec.name}'", {k.name: None for k in spec.keywords})


def _optimizer(info: Any) -> str | None:
    who = f"its optimizer '{info.name}'"
    # :schedule and :clip are every optimizer's: an option so named could never be set
    problem = _named("optimizer", info) or _options(who, info.options, ("schedule", "clip"))
    if problem:
        return problem
    if not callable(info.state_names):
        return f"{who} has no state_names function"
    try:
        names = tuple(info.state_names(dict(info.options)))
    except Exception as exc:
        return f"{who}: state_names failed on its defaults: {exc!r}"
    if not all(isinstance(n, str) and n and "/" not in n for n in names):
        return f"{who} names states {names!r}; a name is text without '/'"
    return None


def _data_source(info: Any) -> str | None:
    return _named("data source", info) or _options(f"its data source '{info.name}'", info.options)


FLAG = re.compile(r"--[a-z][a-z0-9]*(-[a-z0-9]+)*")
"""A flag a plugin adds to ``sexpgpu run``: a long option of lower-case words."""


def _run_option(info: Any) -> str | None:
    who = f"its run option {info.flag!r}"
    if not isinstance(info.flag, str) or not FLAG.fullmatch(info.flag):
        return f"{who} is no long option (--, then lower-case words joined by '-')"
    if not isinstance(info.choice, str) or not info.choice:
        return f"{who} requests the choice {_value_text(info.choice)}, not a name"
    values, minimum = tuple(info.values or ()), info.minimum
    if not all(isinstance(v, str) and v for v in values):
        return f"{who} takes the values {values!r}, not all of them words"
    if values and minimum is not None:
        return f"{who} takes both words and integers (values and minimum): one or neither"
    if minimum is not None and (not isinstance(minimum, int) or isinstance(minimum, bool)):
        return f"{who} takes integers no less than {_value_text(minimum)}, not an integer"
    return None


CONTRACTS: dict[str, Callable[[Any], str | None]] = {
    "sexpgpu_data_sources": _data_source,
    "sexpgpu_run_options": _run_option,
    "sexpgpu_eval_metrics": _eval_metric,
    "sexpgpu_ops": _op,
    "sexpgpu_optimizers": _optimizer,
}
"""Per supplying hook, the check of one descriptor: ``None``, or why it cannot be used."""


def broken(hook: str, info: Any) -> str | None:
    """Why descriptor ``info`` of ``hook`` cannot be used, or ``None``."""
    check = CONTRACTS.get(hook)
    try:
        return check(info) if check is not None else None
    except Exception as exc:  # a malformed descriptor (no name, no text) is broken too
        return f"a descriptor of {hook} is malformed: {exc!r}"


def op_claims(info: Any) -> tuple[str, ...]:
    """What an op descriptor claims, as conflicts key it: a new op its name and every
    surface name its spec gives it (``op 'leaky-relu'``); an implementation of a
    built-in op, that op for each lowering it implements it for."""
    spec = info.spec
    if spec is not None and BUILTINS.get(info.name) is spec:
        # each lowering may have one implementation of a built-in op, from one plugin
        lowerings = sorted(info.implementations or {})
        return tuple(f"{lowering} implementation of op '{info.name}'" for lowering in lowerings)
    surfaces = getattr(spec, "surfaces", None) or ()
    return tuple(dict.fromkeys(f"op '{name}'" for name in (info.name, *surfaces)))


def built_in_op_claims() -> list[str]:
    """The claims of the language's own ops: a plugin op named like one would never be
    called, so it is a conflict."""
    names = {name for spec in BUILTINS.specs() for name in (spec.name, *spec.surfaces)}
    return sorted(f"op '{name}'" for name in names)

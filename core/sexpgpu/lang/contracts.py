"""What a plugin's descriptors must be for the language to use them, checked when the
catalog first asks the plugin for them: a plugin that breaks one is unavailable, with
the reason, in ``sexpgpu plugins`` and in the error of a program that uses it.

Only what can be told from the descriptor alone is here. What depends on a program
(an op's output on the program's shapes, an optimizer's states on its parameters)
is checked when the program is lowered, by the lowering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sexpgpu.errors import SexpError
from sexpgpu.lang.ops import BUILTINS, STRUCTURAL, OpSpec
from sexpgpu.lang.reader import read

__all__ = ["CONTRACTS", "broken", "built_in_op_claims", "op_claims"]


def _eval_metric(info: Any) -> str | None:
    try:
        forms = read(info.expression, f"<metric {info.name}>")
    except SexpError as exc:
        return f"its eval metric '{info.name}' does not parse: {exc.render()}"
    if len(forms) != 1:
        return f"its eval metric '{info.name}' is {len(forms)} expressions, not one"
    return None


def _op(info: Any) -> str | None:
    spec = getattr(info, "spec", None)
    if not isinstance(spec, OpSpec):
        return f"its op '{info.name}' has no OpSpec"
    if BUILTINS.get(spec.name) is spec:
        return None  # a lowering's implementation of a built-in op
    if spec.name in STRUCTURAL:
        return f"it supplies an op '{spec.name}', a name the IR keeps"
    if spec.node and spec.infer is None and spec.compile is None:
        return f"it supplies the op '{spec.name}' without an infer"
    return None


def _optimizer(info: Any) -> str | None:
    if not callable(getattr(info, "state_names", None)):
        return f"its optimizer '{info.name}' has no state_names function"
    try:
        names = tuple(info.state_names(dict(info.options)))
    except Exception as exc:
        return f"its optimizer '{info.name}': state_names failed on its defaults: {exc!r}"
    if not all(isinstance(n, str) and n and "/" not in n for n in names):
        return f"its optimizer '{info.name}' names states {names!r}; a name is text without '/'"
    return None


CONTRACTS: dict[str, Callable[[Any], str | None]] = {
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
    spec = getattr(info, "spec", None)
    if spec is not None and BUILTINS.get(info.name) is spec:
        # each lowering may have one implementation of a built-in op, from one plugin
        lowerings = sorted(getattr(info, "implementations", None) or {})
        return tuple(f"{lowering} implementation of op '{info.name}'" for lowering in lowerings)
    surfaces = getattr(spec, "surfaces", None) or ()
    return tuple(dict.fromkeys(f"op '{name}'" for name in (info.name, *surfaces)))


def built_in_op_claims() -> list[str]:
    """The claims of the language's own ops: a plugin op named like one would never be
    called, so it is a conflict."""
    names = {name for spec in BUILTINS.specs() for name in (spec.name, *spec.surfaces)}
    return sorted(f"op '{name}'" for name in names)

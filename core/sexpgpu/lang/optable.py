"""The op table a program's graphs are built with: the built-in ops of the registry
(:mod:`sexpgpu.lang.ops`), the ops plugins supply through ``sexpgpu_ops`` (found
in the catalog by the name a call writes), and the type rule of every op."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import PluginError, Pos, SexpError, SourceError
from sexpgpu.lang import ir as g
from sexpgpu.lang.ops import BUILTINS, OpSpec
from sexpgpu.lang.ops import infer as infer_builtin
from sexpgpu.plugin_supplies import exception_text

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

__all__ = ["E_PLUGIN_CALL", "OPS_HOOK", "OpTable", "plugin_call"]

OPS_HOOK = "sexpgpu_ops"
E_PLUGIN_CALL = "E-PLUGIN-002"
"""A plugin's callable that raised something other than a sexpgpu error as a program
is compiled (an op's ``infer``, ``compile`` or ``fold``, a data source's
``prompt_length``), or an op's ``infer`` that returned no tensor type: its mistake."""


class OpTable:
    """The ops a call may name: built-in ones, and those plugins supply (looked up in
    the catalog on first use); and the typing of a node of any of them."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._found: dict[str, OpSpec] = {}
        self._clashes: list[Any] | None = None

    def builtin(self, name: str, pos: Pos) -> tuple[OpSpec, str] | None:
        """The built-in op ``name`` calls, and the surface name it is found by
        (``layer_norm`` is found as ``layer-norm``); ``None`` when none is. A plugin
        op of the same name is a conflict (``E-PLUGIN-001``), as ``sexpgpu plugins`` says."""
        for surface in (name, name.replace("_", "-")):
            spec = BUILTINS.surface(surface)
            if spec is not None:
                what = f"op '{surface}'"
                clash = next((c for c in self._conflicts() if c.what == what), None)
                if clash is not None:
                    refusal = clash.error()
                    raise SourceError(refusal.message, code=refusal.code, pos=pos)
                return spec, surface
        return None

    def _conflicts(self) -> list[Any]:
        if self._clashes is None:
            self._clashes = self._catalog.conflicts(OPS_HOOK)
        return self._clashes

    def find(self, name: str, pos: Pos) -> OpSpec | None:
        """The spec of plugin op ``name`` (recording its plugin), ``None`` when no
        plugin supplies it; a positioned error when its plugin is unavailable or
        two plugins supply it."""
        if name in self._found:
            return self._found[name]
        plugins = self._catalog
        offers = [(i, r) for i, r in plugins.supplied(OPS_HOOK) if _offers(i, name)]
        if not offers:
            return None
        try:
            # one rule for every lookup: a conflict is E-PLUGIN-001 naming both plugins,
            # an unavailable plugin is named with its reason
            chosen = plugins.require(OPS_HOOK, f"the op '{name}'", lambda i: _offers(i, name))
        except PluginError as exc:
            raise SourceError(exc.message, code=exc.code, pos=pos) from None
        record = next(r for i, r in offers if r.available)
        spec = _guarded(chosen.spec, record.name)  # held to lang.contracts
        self._found[name] = self._found[spec.name] = spec
        return spec

    def get(self, op: str) -> OpSpec | None:
        """The spec of a plugin op found already, by its IR name."""
        return self._found.get(op)

    def infer(
        self, op: str, args: Sequence[g.TensorType], attrs: Mapping[str, Any], pos: Pos
    ) -> g.TensorType:
        """The type of a node of ``op``: a built-in's rule, or a plugin op's."""
        spec = BUILTINS.get(op) or self._found.get(op)
        if spec is not None and spec.infer is not None and spec.plugin is not None:
            return spec.infer(op, args, attrs, pos)
        return infer_builtin(op, args, attrs, pos)

    def names(self) -> list[str]:
        """The surface names of the ops available plugins supply (for suggestions)."""
        return [
            s
            for info, record in self._catalog.supplied(OPS_HOOK)
            if record.available and _offers(info, None)
            for s in info.spec.surfaces
        ]

    def hint(self) -> str:
        """What to add to "unknown op" when disabled plugins might have supplied it."""
        return self._catalog.disabled_hint()


def _offers(info: Any, name: str | None) -> bool:
    """Whether ``info`` is a new op (called ``name``, when given)."""
    spec = info.spec
    if not isinstance(spec, OpSpec) or BUILTINS.get(spec.name) is not None:
        return False  # a lowering's implementation of a built-in op, not a new op
    return name is None or name in spec.surfaces


def _guarded(spec: OpSpec, plugin: str) -> OpSpec:
    """``spec`` as ``plugin`` supplies it, each of its callables (``infer``, ``compile``,
    ``fold``) guarded: an exception from one that is no :class:`SexpError` (a user's
    mistake the op found), or an ``infer`` that types nothing, is one line
    (``E-PLUGIN-002``) naming the plugin, the op and the call in the user's file."""

    who = f"the op '{spec.name}' of the plugin '{plugin}'"

    def guard(member: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any) -> Any:
            # infer(op, types, attrs, pos), fold(values, pos), compile(call): call.pos
            places = (*args, *(getattr(arg, "pos", None) for arg in args))
            where = next((place for place in places if isinstance(place, Pos)), None)
            result = plugin_call(who, member, call, *args, pos=where)
            if member == "infer" and not _typed(result):
                message = f"{who}: its infer returned {result!r:.60}, not a TensorType"
                raise PluginError(message, code=E_PLUGIN_CALL, pos=where)
            return result

        return guarded

    members = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    guards = {name: guard(name, value) for name, value in members.items() if callable(value)}
    return dataclasses.replace(spec, plugin=plugin, **guards)


def plugin_call(
    who: str, member: str, call: Callable[..., Any], *args: Any, pos: Pos | None
) -> Any:
    """``call(*args)``, the ``member`` (``infer``) of ``who`` (``the op 'x' of the plugin
    'p'``) called as a program is compiled: what escapes it that is no :class:`SexpError`
    (a user's mistake the plugin found) is the plugin's bug, one line (``E-PLUGIN-002``)."""
    try:
        return call(*args)
    except SexpError:
        raise
    except Exception as exc:
        message = f"{who}: its {member} raised {exception_text(exc)}"
        raise PluginError(message, code=E_PLUGIN_CALL, pos=pos) from None


def _typed(result: Any) -> bool:
    """Whether ``result`` is a tensor type a graph can hold."""
    return (
        isinstance(result, g.TensorType)
        and result.dtype in g.DTYPES
        and isinstance(result.shape, tuple)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in result.shape)
    )

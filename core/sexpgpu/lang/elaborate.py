"""The ``elaborate`` pass: the run's roots (``:model`` and ``:with-loaded``) made
into layer instances at their paths, ``repeat`` stacks included, with every
parameter declared."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang import ir as g
from sexpgpu.lang.definitions import CORE_NAME, Definitions, LayerDef
from sexpgpu.lang.defrun import RunForm
from sexpgpu.lang.knobs import Knobs
from sexpgpu.lang.model import MAX_REPEAT, Instance, Model, Stack, framed
from sexpgpu.lang.params import Loaded, ParamReader
from sexpgpu.lang.reader import SList, Sym, show
from sexpgpu.lang.static import Statics
from sexpgpu.lang.syntax import FileCheck, pick_keywords, split_args
from sexpgpu.lang.text import err, listing, suggest

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

__all__ = ["elaborate"]

# the layers being made, outermost first: a layer found among them contains itself
Active = tuple[tuple[str, Pos], ...]


def elaborate(
    defs: Definitions,
    knobs: Knobs,
    run: RunForm,
    catalog: Catalog,
    *,
    files: FileCheck | None = None,
) -> Model:
    """Make the roots ``run`` names from the layers of ``defs``; ``catalog`` is asked
    which storage schemes a ``:load`` may name, and ``files`` which files."""
    maker = _Maker(defs, Statics(knobs.values), catalog, files)
    opts = run.opts
    if "model" not in opts:
        raise err("defrun needs :model, e.g. :model (net 32 8)", run.form.pos)
    model = maker.instantiate(opts["model"], "model", {}, (), None)
    if not isinstance(model, Instance):
        raise err(":model is a layer such as (net 32 8), not a repeat", opts["model"].pos)
    roots = {"model": model}
    if "with-loaded" in opts:
        name, inst = maker.with_loaded(opts["with-loaded"], roots)
        roots[name] = inst
    return Model(roots, tuple(maker.params))


class _Maker:
    """Makes instances; the parameters declared so far, in order."""

    def __init__(
        self, defs: Definitions, statics: Statics, catalog: Catalog, files: FileCheck | None
    ) -> None:
        self.layers = defs.layers
        self.core_layers = defs.core_layers
        self.statics = statics
        self.param_reader = ParamReader(statics, catalog, files)
        self.params: list[g.ParamDecl] = []

    def instantiate(
        self, ctor: Any, path: str, env: Mapping[str, Any], active: Active, loaded: Loaded | None
    ) -> Instance | Stack:
        """Make the layer ``ctor`` names at ``path``, with its parameters declared."""
        if isinstance(ctor, Sym):
            ctor = SList((ctor,), ctor.pos)
        if not isinstance(ctor, SList) or not ctor.items or not isinstance(ctor.items[0], Sym):
            raise err(f"expected a layer such as (mlp dim), got {show(ctor)}", ctor.pos)
        head = ctor.items[0]
        if head.name == "repeat":
            return self.stack(ctor, path, env, active, loaded)
        ldef = self.layer_named(head)
        if (ldef.name, ldef.pos) in active:
            chain = " -> ".join([*(n for n, _ in active), ldef.name])
            raise err(f"layer '{ldef.name}' contains itself ({chain})", head.pos)
        statics = self.bind_ctor(ldef, ctor, env)
        inst = Instance(path, ldef, statics)
        try:
            self.fill(inst, (*active, (ldef.name, ldef.pos)), loaded)
        except SourceError as exc:
            raise framed(exc, ctor.pos, inst) from None
        return inst

    def stack(
        self, ctor: SList, path: str, env: Mapping[str, Any], active: Active, loaded: Loaded | None
    ) -> Stack:
        """``(repeat N layer)``: N instances of the layer at ``path.0`` ... ``path.N-1``."""
        if len(ctor.items) != 3:
            raise err("repeat takes a count and a layer: (repeat 4 (block dim))", ctor.pos)
        count = self.statics.int_of(ctor.items[1], env, "repeat's count", 1)
        if count > MAX_REPEAT:
            raise err(f"repeat's count {count} is more than {MAX_REPEAT}", ctor.items[1].pos)
        inner = ctor.items[2]
        if (
            isinstance(inner, SList)
            and inner.items
            and isinstance(inner.items[0], Sym)
            and inner.items[0].name == "repeat"
        ):
            raise err(
                "a repeat directly inside a repeat: use one (repeat (* a b) layer)", inner.pos
            )
        items = []
        for i in range(count):
            inst = self.instantiate(inner, f"{path}.{i}", env, active, loaded)
            assert isinstance(inst, Instance)
            items.append(inst)
        return Stack(path, count, items, ctor.pos)

    def layer_named(self, head: Sym) -> LayerDef:
        """The layer ``head`` names: in a prelude layer the prelude's, elsewhere the user's first."""
        first, second = (
            (self.core_layers, self.layers)
            if head.pos.file == CORE_NAME
            else (self.layers, self.core_layers)
        )
        ldef = first.get(head.name) or second.get(head.name)
        if ldef is None:
            known = [*self.layers, *self.core_layers]
            raise err(
                f"unknown layer '{head.name}'{suggest(head.name, known)}; layers: {listing(known)}",
                head.pos,
            )
        return ldef

    def fill(self, inst: Instance, active: Active, loaded: Loaded | None) -> None:
        """Declare ``inst``'s parameters and make its sub-layers."""
        path, statics = inst.path, inst.statics
        for item in inst.ldef.items:
            kind, name = item.items[0].name, item.items[1].name
            if kind == "param":
                decl = self.param_reader.decl(item, f"{path}.{name}", statics, loaded)
                inst.params[name] = decl
                self.params.append(decl)
            else:
                if len(item.items) != 3:
                    raise err(
                        f"layer takes a name and one layer: (layer {name} (mlp dim))", item.pos
                    )
                inst.subs[name] = self.instantiate(
                    item.items[2], f"{path}.{name}", statics, active, loaded
                )

    def bind_ctor(self, ldef: LayerDef, ctor: SList, env: Mapping[str, Any]) -> dict[str, Any]:
        """The values of ``ldef``'s constructor parameters in the call ``ctor``."""
        positional, keywords = split_args(ctor.items[1:])
        if len(positional) > len(ldef.params):
            raise err(
                f"{ldef.name} takes {len(ldef.params)} argument{'s' if len(ldef.params) != 1 else ''}"
                f" ({' '.join(ldef.params) or 'none'}), got {len(positional)}",
                ctor.pos,
            )
        statics: dict[str, Any] = {}
        for pname, node in zip(ldef.params, positional, strict=False):
            statics[pname] = self.statics.static(node, env)
        for kw, node in keywords:
            if kw.name not in ldef.params:
                raise err(
                    f"{ldef.name} has no parameter :{kw.name}{suggest(kw.name, ldef.params)}; its parameters: {listing(ldef.params, ':')}",
                    kw.pos,
                )
            if kw.name in statics:
                raise err(f":{kw.name} is given twice", kw.pos)
            statics[kw.name] = self.statics.static(node, env)
        missing = [p for p in ldef.params if p not in statics]
        if missing:
            raise err(
                f"{ldef.name} needs {' '.join(missing)} ({ldef.name} {' '.join(ldef.params)})",
                ctor.pos,
            )
        return statics

    def with_loaded(self, node: Any, roots: Mapping[str, Instance]) -> tuple[str, Instance]:
        """``:with-loaded (name (layer ...) :file URI :names TEMPLATE)``: a frozen second root."""
        usage = (
            ':with-loaded (teacher (net 32 8) :file "teacher.safetensors" :names "{path}.weight")'
        )
        if not isinstance(node, SList) or len(node.items) < 2 or not isinstance(node.items[0], Sym):
            raise err(f"expected {usage}", node.pos)
        name = node.items[0]
        if name.name in roots or "." in name.name:
            raise err(f"a second root needs its own name, not '{name.name}'", name.pos)
        positional, keywords = split_args(node.items[2:])
        if positional:
            raise err(f"expected {usage}", positional[0].pos)
        opts = pick_keywords(keywords, ("file", "names"), "with-loaded")
        if "file" not in opts:
            raise err(f"with-loaded needs :file: {usage}", node.pos)
        uri = self.statics.static(opts["file"], {})
        if not isinstance(uri, str):
            raise err(":file is a string", opts["file"].pos)
        uri = self.param_reader.check_uri(uri, opts["file"].pos)
        template = "{path}"
        if "names" in opts:
            template = self.statics.static(opts["names"], {})
            if not isinstance(template, str) or (
                "{path}" not in template and "{name}" not in template
            ):
                raise err(
                    ':names maps a parameter to its tensor with {path} (teacher.ff.up) or {name} (ff.up), e.g. "{path}.weight"',
                    opts["names"].pos,
                )
        inst = self.instantiate(node.items[1], name.name, {}, (), Loaded(uri, template))
        if not isinstance(inst, Instance):
            raise err(
                "a second root is a layer such as (net 32 8), not a repeat", node.items[1].pos
            )
        return name.name, inst

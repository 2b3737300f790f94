"""Layers and parameters: instantiating ``deflayer``s (and ``repeat`` stacks) at
their paths, declaring parameters, initializers and ``:load`` files."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sexpgpu import graph as g
from sexpgpu.errors import PluginError, Pos, SourceError
from sexpgpu.lang.ops import FLOATS
from sexpgpu.lang.reader import SList, SVec, Sym, show
from sexpgpu.lang.text import err, listing, suggest
from sexpgpu.lang.values import (
    CORE_NAME,
    MAX_REPEAT,
    Instance,
    LayerDef,
    Stack,
    framed,
    pick_keywords,
    relative_to_file,
    split_args,
)

STORAGE_HOOK = "sexpgpu_storage_backends"


class LayersMixin:
    """The compiler's making of layer instances and their parameters."""

    def instantiate(
        self,
        ctor: Any,
        path: str,
        env: Mapping[str, Any],
        active: tuple[tuple[str, Pos], ...],
        root: dict[str, Any],
    ) -> Instance | Stack:
        """Make the layer ``ctor`` names at ``path``, with its parameters declared."""
        if isinstance(ctor, Sym):
            ctor = SList((ctor,), ctor.pos)
        if not isinstance(ctor, SList) or not ctor.items or not isinstance(ctor.items[0], Sym):
            raise err(f"expected a layer such as (mlp dim), got {show(ctor)}", ctor.pos)
        head = ctor.items[0]
        if head.name == "repeat":
            if len(ctor.items) != 3:
                raise err("repeat takes a count and a layer: (repeat 4 (block dim))", ctor.pos)
            count = self.int_of(ctor.items[1], env, "repeat's count", 1)
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
                inst = self.instantiate(inner, f"{path}.{i}", env, active, root)
                assert isinstance(inst, Instance)
                items.append(inst)
            return Stack(path, count, items, ctor.pos)
        # a name in a prelude layer means the prelude's layer; elsewhere the user's comes first
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
        if (ldef.name, ldef.pos) in active:
            chain = " -> ".join([*(n for n, _ in active), ldef.name])
            raise err(f"layer '{ldef.name}' contains itself ({chain})", head.pos)
        statics = self._bind_ctor(ldef, ctor, env)
        inst = Instance(path, ldef, statics)
        try:
            self._fill(inst, (*active, (ldef.name, ldef.pos)), root)
        except SourceError as exc:
            raise framed(exc, ctor.pos, inst) from None
        return inst

    def _fill(
        self, inst: Instance, active: tuple[tuple[str, Pos], ...], root: dict[str, Any]
    ) -> None:
        """Declare ``inst``'s parameters and make its sub-layers."""
        path, statics = inst.path, inst.statics
        for item in inst.ldef.items:
            kind, name = item.items[0].name, item.items[1].name
            if kind == "param":
                decl = self.param_decl(item, f"{path}.{name}", statics, root)
                inst.params[name] = decl
                self.params.append(decl)
            else:
                if len(item.items) != 3:
                    raise err(
                        f"layer takes a name and one layer: (layer {name} (mlp dim))", item.pos
                    )
                inst.subs[name] = self.instantiate(
                    item.items[2], f"{path}.{name}", statics, active, root
                )

    def _bind_ctor(self, ldef: LayerDef, ctor: SList, env: Mapping[str, Any]) -> dict[str, Any]:
        positional, keywords = split_args(ctor.items[1:])
        if len(positional) > len(ldef.params):
            raise err(
                f"{ldef.name} takes {len(ldef.params)} argument{'s' if len(ldef.params) != 1 else ''}"
                f" ({' '.join(ldef.params) or 'none'}), got {len(positional)}",
                ctor.pos,
            )
        statics: dict[str, Any] = {}
        for pname, node in zip(ldef.params, positional, strict=False):
            statics[pname] = self.static(node, env)
        for kw, node in keywords:
            if kw.name not in ldef.params:
                raise err(
                    f"{ldef.name} has no parameter :{kw.name}{suggest(kw.name, ldef.params)}; its parameters: {listing(ldef.params, ':')}",
                    kw.pos,
                )
            if kw.name in statics:
                raise err(f":{kw.name} is given twice", kw.pos)
            statics[kw.name] = self.static(node, env)
        missing = [p for p in ldef.params if p not in statics]
        if missing:
            raise err(
                f"{ldef.name} needs {' '.join(missing)} ({ldef.name} {' '.join(ldef.params)})",
                ctor.pos,
            )
        return statics

    def param_decl(
        self, item: SList, path: str, env: Mapping[str, Any], root: dict[str, Any]
    ) -> g.ParamDecl:
        """A ``(param name [shape] :init ... :dtype ... :frozen ... :tags ... :load ...)`` at ``path``."""
        name = item.items[1]
        positional, keywords = split_args(item.items[2:])
        if len(positional) != 1:
            raise err(
                f"param {name.name} takes one shape, e.g. (param {name.name} [dim dim] :init (normal 0.02))",
                item.pos,
            )
        shape_node = positional[0]
        if not isinstance(shape_node, SVec):
            raise err(
                f"a shape is a vector such as [vocab dim], got {show(shape_node)}", shape_node.pos
            )
        shape = tuple(self.int_of(d, env, "a dimension", 1) for d in shape_node.items)
        opts = pick_keywords(keywords, ("init", "dtype", "frozen", "tags", "load"), "param")
        dtype = "f32"
        if "dtype" in opts:
            dtype = self.word(opts["dtype"], env, "a dtype")
            if dtype not in FLOATS:
                raise err(f"a parameter's dtype is f32 or bf16, got {dtype}", opts["dtype"].pos)
        init = self.init_of(opts["init"], env) if "init" in opts else g.Init("normal", (0.02,))
        frozen = self.bool_of(opts["frozen"], env, ":frozen") if "frozen" in opts else False
        tags = self.words(opts["tags"], env, "tags") if "tags" in opts else ()
        load = self.load_of(opts["load"], env) if "load" in opts else None
        if root.get("loaded"):
            # a with-loaded root: every parameter is read from its file, frozen
            frozen = True
            if load is None:
                uri, template = root["loaded"]
                load = g.LoadSpec(
                    uri, template.replace("{path}", path).replace("{name}", path.split(".", 1)[1])
                )
        return g.ParamDecl(path, g.TensorType(shape, dtype), init, not frozen, tags, load, name.pos)

    def init_of(self, node: Any, env: Mapping[str, Any]) -> g.Init:
        """An initializer: ``(normal std)``, ``(uniform low high)``, ``zeros``, ``xavier``..."""
        spec = {
            "normal": (1, 1),
            "uniform": (2, 2),
            "zeros": (0, 0),
            "ones": (0, 0),
            "xavier": (0, 1),
            "kaiming": (0, 1),
        }
        if isinstance(node, Sym):
            head, args, pos = node.name, [], node.pos
        elif isinstance(node, SList) and node.items and isinstance(node.items[0], Sym):
            head, args, pos = node.items[0].name, list(node.items[1:]), node.pos
        else:
            raise err(f"expected an initializer such as (normal 0.02), got {show(node)}", node.pos)
        if head not in spec:
            raise err(
                f"unknown initializer '{head}'{suggest(head, spec)}; initializers: {listing(spec)}",
                pos,
            )
        lo, hi = spec[head]
        if not lo <= len(args) <= hi:
            want = {"normal": "(normal std)", "uniform": "(uniform low high)"}.get(
                head, f"({head} [gain])"
            )
            raise err(
                f"{head} takes {lo}{'' if lo == hi else f' to {hi}'} argument{'s' if hi != 1 else ''}: {want}",
                pos,
            )
        values = tuple(self.num_of(a, env, f"{head}'s argument") for a in args)
        if head == "normal" and values[0] < 0:
            raise err(f"normal's std must be >= 0, got {values[0]}", args[0].pos)
        if head == "uniform" and not values[0] < values[1]:
            raise err(f"uniform needs low < high, got {values[0]} and {values[1]}", pos)
        if head in ("xavier", "kaiming") and not values:
            values = (1.0,)
        return g.Init(head, values)

    def load_of(self, node: Any, env: Mapping[str, Any]) -> g.LoadSpec:
        """``(file URI TENSOR)``: where a parameter's start value is read from."""
        if not (
            isinstance(node, SList)
            and len(node.items) == 3
            and isinstance(node.items[0], Sym)
            and node.items[0].name == "file"
        ):
            raise err(
                f':load takes (file "weights.safetensors" "tensor.name"), got {show(node)}',
                node.pos,
            )
        uri = self.static(node.items[1], env)
        tensor = self.static(node.items[2], env)
        if not isinstance(uri, str) or not isinstance(tensor, str) or not uri or not tensor:
            raise err(
                "(file ...) takes two strings: the file and the tensor's name in it", node.pos
            )
        return g.LoadSpec(self.check_uri(uri, node.items[1].pos), tensor)

    def check_uri(self, uri: str, pos: Pos) -> str:
        """A ``:load`` location: a scheme a storage backend opens, a safetensors file
        or index; a relative path is made relative to the file that names it."""
        scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", uri)
        self.check_scheme(scheme.group(1) if scheme else "file", pos)
        if not (uri.endswith(".safetensors") or uri.endswith(".safetensors.index.json")):
            raise err(
                f"a :load file is a .safetensors file or a .safetensors.index.json index, got '{uri}'",
                pos,
            )
        return relative_to_file(uri, pos)

    def check_scheme(self, scheme: str, pos: Pos) -> None:
        """Refuse a ``:load`` scheme no available storage backend opens (a plain
        path is ``file``), naming the schemes there are, or the plugin that is
        unavailable."""
        plugins = self.plugins()
        offered = {s for info, _ in plugins.supplied(STORAGE_HOOK) for s in info.schemes}
        if scheme not in offered:
            schemes = {s for info in plugins.available(STORAGE_HOOK) for s in info.schemes}
            raise err(
                f"a :load file's scheme '{scheme}' has no storage backend here;"
                f" schemes: {listing(schemes)}",
                pos,
            )
        what = f"the :load scheme '{scheme}'"
        try:
            plugins.require(STORAGE_HOOK, what, lambda info: scheme in info.schemes)
        except PluginError as exc:
            raise SourceError(exc.message, code=exc.code, pos=pos) from None

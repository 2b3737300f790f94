r"""Parameters: a layer's ``(param ...)`` items read into :class:`ParamDecl`\ s, with
their initializers and ``:load`` files (whose schemes the storage plugins open)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import PluginError, Pos, SourceError
from sexpgpu.lang import ir as g
from sexpgpu.lang.ops import FLOATS
from sexpgpu.lang.reader import SList, SVec, Sym, show
from sexpgpu.lang.static import Statics
from sexpgpu.lang.syntax import (
    FileCheck,
    checked_location,
    pick_keywords,
    relative_to_file,
    split_args,
)
from sexpgpu.lang.text import err, listing, suggest

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

__all__ = ["STORAGE_HOOK", "Loaded", "ParamReader"]

STORAGE_HOOK = "sexpgpu_storage_backends"

_INITS = {
    "normal": (1, 1),
    "uniform": (2, 2),
    "zeros": (0, 0),
    "ones": (0, 0),
    "xavier": (0, 1),
    "kaiming": (0, 1),
}
"""Each initializer's least and most number of arguments."""


@dataclass(frozen=True)
class Loaded:
    """A ``:with-loaded`` root's file, and the template naming each parameter's tensor in it."""

    uri: str
    template: str

    def spec(self, path: str) -> g.LoadSpec:
        """Where the parameter at ``path`` is read from."""
        name = path.split(".", 1)[1]
        return g.LoadSpec(self.uri, self.template.replace("{path}", path).replace("{name}", name))


class ParamReader:
    """Reads parameter declarations, their values known by ``statics``, their files'
    schemes checked against ``catalog``'s storage backends, their files taken by ``files``."""

    def __init__(self, statics: Statics, catalog: Catalog, files: FileCheck | None = None) -> None:
        self.statics = statics
        self.catalog = catalog
        self.files = files

    def decl(
        self, item: SList, path: str, env: Mapping[str, Any], loaded: Loaded | None
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
        shape = tuple(self.statics.int_of(d, env, "a dimension", 1) for d in shape_node.items)
        opts = pick_keywords(keywords, ("init", "dtype", "frozen", "tags", "load"), "param")
        dtype = "f32"
        if "dtype" in opts:
            dtype = self.statics.word(opts["dtype"], env, "a dtype")
            if dtype not in FLOATS:
                raise err(f"a parameter's dtype is f32 or bf16, got {dtype}", opts["dtype"].pos)
        init = self.init_of(opts["init"], env) if "init" in opts else g.Init("normal", (0.02,))
        frozen = self.statics.bool_of(opts["frozen"], env, ":frozen") if "frozen" in opts else False
        tags = self.statics.words(opts["tags"], env, "tags") if "tags" in opts else ()
        load = self.load_of(opts["load"], env) if "load" in opts else None
        if loaded is not None:
            # a with-loaded root: every parameter is read from its file, frozen
            frozen = True
            if load is None:
                load = loaded.spec(path)
        return g.ParamDecl(path, g.TensorType(shape, dtype), init, not frozen, tags, load, name.pos)

    def init_of(self, node: Any, env: Mapping[str, Any]) -> g.Init:
        """An initializer: ``(normal std)``, ``(uniform low high)``, ``zeros``, ``xavier``..."""
        spec = _INITS
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
        values = tuple(self.statics.num_of(a, env, f"{head}'s argument") for a in args)
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
        uri = self.statics.static(node.items[1], env)
        tensor = self.statics.static(node.items[2], env)
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
        return checked_location(self.files, "load", relative_to_file(uri, pos), pos)

    def check_scheme(self, scheme: str, pos: Pos) -> None:
        """Refuse a ``:load`` scheme no available storage backend opens (a plain
        path is ``file``), naming the schemes there are, or the plugin that is
        unavailable."""
        plugins = self.catalog
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

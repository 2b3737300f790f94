"""The ``collect`` pass: sources (the `<core>` prelude, the main file and what it
includes) read into their top-level :class:`Definitions`.

Nothing is evaluated here: knobs keep their defaults, layers their forms, and
``defdata``/``defrun`` are kept as written for the later passes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang import ir as g
from sexpgpu.lang.definitions import (
    CORE_NAME,
    Definitions,
    KnobDef,
    LayerDef,
    SourceText,
    VariantDef,
)
from sexpgpu.lang.reader import Atom, Kw, SList, Sym, read, show
from sexpgpu.lang.syntax import FileCheck, checked_location
from sexpgpu.lang.text import err, suggest

__all__ = ["MAX_SOURCE_BYTES", "TOP_LEVEL", "collect", "read_source_file"]

MAX_SOURCE_BYTES = 16 << 20
"""The largest `.sx` source ``include`` reads (docs/language.md); a larger one is refused."""

TOP_LEVEL = ("include", "defknob", "defvariant", "deflayer", "defmodel", "defdata", "defrun")


def read_source_file(path: str) -> bytes:
    """The bytes of a source file: a regular file of at most :data:`MAX_SOURCE_BYTES`;
    a device (``/dev/zero``), a FIFO or a larger file raises :class:`OSError`
    without reading (or waiting on) it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file")
        if info.st_size > MAX_SOURCE_BYTES:
            raise OSError(
                errno.EFBIG, f"it is larger than the {MAX_SOURCE_BYTES} bytes a source may have"
            )
        os.set_blocking(fd, True)
        data = f.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:  # it grew since it was measured
        raise OSError(
            errno.EFBIG, f"it is larger than the {MAX_SOURCE_BYTES} bytes a source may have"
        )
    return data


def collect(core: SourceText, main: SourceText, *, files: FileCheck | None = None) -> Definitions:
    """Read the prelude ``core``, then ``main`` and its includes (each file once,
    relative to the file that includes it, and taken by ``files`` before it is read),
    into their definitions."""
    collector = _Collector(os.path.dirname(main.file) or ".", files)
    collector.load(core)
    if main.path is not None:
        collector.read_paths.add(main.path)
    collector.load(main)
    return Definitions(
        file=main.file,
        sources=tuple(collector.sources),
        layers=collector.layers,
        core_layers=collector.core_layers,
        knobs=collector.knobs,
        variants=collector.variants,
        datas=collector.datas,
        run=collector.run,
    )


class _Collector:
    """The definitions so far while the sources are read."""

    def __init__(self, base_dir: str, files: FileCheck | None = None) -> None:
        self.base_dir = base_dir
        self.files = files
        self.sources: list[g.Source] = []
        self.read_paths: set[str] = set()
        # the files being read, outermost first: an include of one of them is a cycle
        self.reading: list[tuple[str | None, str]] = []
        self.layers: dict[str, LayerDef] = {}
        self.core_layers: dict[str, LayerDef] = {}
        self.knobs: dict[str, KnobDef] = {}
        self.variants: dict[str, VariantDef] = {}
        self.datas: dict[str, SList] = {}
        self.run: SList | None = None
        self.handlers: dict[str, Callable[[SList, str, bool], None]] = {
            "include": self.form_include,
            "defknob": self.form_defknob,
            "defvariant": self.form_defvariant,
            "deflayer": self.form_deflayer,
            "defmodel": self.form_deflayer,
            "defdata": self.form_defdata,
            "defrun": self.form_defrun,
        }

    def load(self, source: SourceText) -> None:
        """Read one source and collect its top-level forms (includes recursively)."""
        self.sources.append(
            g.Source(source.name, source.path, hashlib.sha256(source.data).hexdigest())
        )
        self.reading.append((source.path, source.name))
        for form in read(source.text, source.file):
            self.toplevel(form, source.file, source.name == CORE_NAME)
        self.reading.pop()

    def toplevel(self, form: Any, file: str, core: bool) -> None:
        """Collect one top-level form by its head."""
        if not isinstance(form, SList) or not form.items or not isinstance(form.items[0], Sym):
            raise err(f"expected a top-level form such as (defrun ...), got {show(form)}", form.pos)
        head = form.items[0]
        handler = self.handlers.get(head.name)
        if handler is None:
            raise err(
                f"unknown top-level form '{head.name}'" + suggest(head.name, TOP_LEVEL), head.pos
            )
        handler(form, file, core)

    def form_include(self, form: SList, file: str, core: bool) -> None:
        """``(include "lib.sx")``: read another file, relative to this one, once."""
        if (
            len(form.items) != 2
            or not isinstance(form.items[1], Atom)
            or not isinstance(form.items[1].value, str)
        ):
            raise err('include takes one file name: (include "lib.sx")', form.pos)
        rel = form.items[1].value
        here = os.path.dirname(file) if file != CORE_NAME else self.base_dir
        shown = os.path.normpath(os.path.join(here, rel))
        resolved = os.path.realpath(shown)
        paths = [path for path, _ in self.reading]
        if resolved in paths:  # a file including itself, or one that includes it
            names = [name for _, name in self.reading[paths.index(resolved) :]]
            raise err(f"include cycle: {' -> '.join([*names, names[0]])}", form.items[1].pos)
        if resolved in self.read_paths:
            return  # each file is read once (two files may include a third)
        checked_location(self.files, "include", shown, form.items[1].pos)
        try:
            data = read_source_file(resolved)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise err(f"cannot read '{rel}': {reason}", form.items[1].pos) from None
        self.read_paths.add(resolved)
        name = os.path.relpath(resolved, os.path.realpath(self.base_dir)).replace(os.sep, "/")
        self.load(SourceText(text, data, shown, name, resolved))

    def form_defknob(self, form: SList, file: str, core: bool) -> None:
        """``(defknob name default "doc")``."""
        name = _name(form, 1, "knob")
        if len(form.items) not in (3, 4):
            raise err(
                'defknob takes a name, a default and an optional doc: (defknob lr 0.5 "learning rate")',
                form.pos,
            )
        default_node = form.items[2]
        if isinstance(default_node, Atom):
            v = default_node.value
            kind = "bool" if isinstance(v, bool) else type(v).__name__
        elif isinstance(default_node, Sym):
            v, kind = default_node.name, "symbol"
        else:
            raise err(
                f"a knob's default must be a number, string, true/false or symbol, got {show(default_node)}",
                default_node.pos,
            )
        doc = ""
        if len(form.items) == 4:
            d = form.items[3]
            if not isinstance(d, Atom) or not isinstance(d.value, str):
                raise err("a knob's doc must be a string", d.pos)
            doc = d.value
        if name.name in self.knobs:
            raise err(
                f"knob '{name.name}' is already defined at {self.knobs[name.name].pos}", name.pos
            )
        self.knobs[name.name] = KnobDef(name.name, v, kind, doc, name.pos)

    def form_defvariant(self, form: SList, file: str, core: bool) -> None:
        """``(defvariant name "doc" :knob value ...)``."""
        name = _name(form, 1, "variant")
        rest = list(form.items[2:])
        if rest and isinstance(rest[0], Atom) and isinstance(rest[0].value, str):
            rest = rest[1:]  # a doc string
        settings: list[tuple[Kw, Any]] = []
        i = 0
        while i < len(rest):
            k = rest[i]
            if not isinstance(k, Kw):
                raise err(f"a variant sets knobs as :name value pairs, got {show(k)}", k.pos)
            if i + 1 >= len(rest):
                raise err(f":{k.name} needs a value", k.pos)
            if any(prev.name == k.name for prev, _ in settings):
                raise err(f":{k.name} is set twice in variant {name.name}", k.pos)
            settings.append((k, rest[i + 1]))
            i += 2
        if name.name in self.variants:
            raise err(
                f"variant '{name.name}' is already defined at {self.variants[name.name].pos}",
                name.pos,
            )
        self.variants[name.name] = VariantDef(name.name, name.pos, tuple(settings))

    def form_deflayer(self, form: SList, file: str, core: bool) -> None:
        """``(deflayer name (params) "doc" (param ...) (layer ...) (forward (x) ...))``."""
        ldef = layer_def(form)
        table = self.core_layers if core else self.layers
        if ldef.name in table:
            raise err(f"layer '{ldef.name}' is already defined at {table[ldef.name].pos}", ldef.pos)
        table[ldef.name] = ldef

    def form_defdata(self, form: SList, file: str, core: bool) -> None:
        """``(defdata name (source :option value) :seq N :batch N)``, read when a run names it."""
        name = _name(form, 1, "data")
        if name.name in self.datas:
            raise err(
                f"data '{name.name}' is already defined at {self.datas[name.name].items[1].pos}",
                name.pos,
            )
        if len(form.items) < 3:
            raise err(
                "defdata needs a source: (defdata train (arithmetic :digits 3) :seq 32 :batch 16)",
                form.pos,
            )
        self.datas[name.name] = form

    def form_defrun(self, form: SList, file: str, core: bool) -> None:
        """``(defrun name :option value ...)``, read once the knobs are settled."""
        _name(form, 1, "run")
        if self.run is not None:
            raise err(f"a program has one defrun; the first is at {self.run.pos}", form.pos)
        self.run = form


def _name(form: SList, index: int, what: str) -> Sym:
    if len(form.items) <= index or not isinstance(form.items[index], Sym):
        raise err(f"{show(form.items[0])} needs a {what} name", form.pos)
    return form.items[index]


def layer_def(form: SList) -> LayerDef:
    """A ``deflayer``/``defmodel`` form read into its :class:`LayerDef`."""
    kind = form.items[0].name
    name = _name(form, 1, "layer" if kind == "deflayer" else "model")
    if len(form.items) < 3 or not isinstance(form.items[2], SList):
        raise err(
            f"{kind} {name.name} needs a parameter list, e.g. ({kind} {name.name} (dim) ...)",
            form.pos,
        )
    params: list[str] = []
    for p in form.items[2].items:
        if not isinstance(p, Sym):
            raise err(f"a {kind} parameter must be a name, got {show(p)}", p.pos)
        if p.name in params:
            raise err(f"parameter '{p.name}' is listed twice", p.pos)
        params.append(p.name)
    items = list(form.items[3:])
    doc = ""
    if items and isinstance(items[0], Atom) and isinstance(items[0].value, str):
        doc = items.pop(0).value
    body: list[SList] = []
    forward: tuple[tuple[str, ...], tuple[Any, ...]] | None = None
    names: dict[str, Pos] = {}
    for item in items:
        if not isinstance(item, SList) or not item.items or not isinstance(item.items[0], Sym):
            raise err(
                f"expected (param ...), (layer ...) or (forward ...) in {name.name}, got {show(item)}",
                item.pos,
            )
        head = item.items[0].name
        if head == "forward":
            if forward is not None:
                raise err(f"{name.name} has a second forward", item.pos)
            forward = _forward(item)
        elif head in ("param", "layer"):
            _body_item(item, head, names)
            body.append(item)
        else:
            raise err(
                f"unknown item '{head}' in {kind} {name.name}"
                + suggest(head, ["param", "layer", "forward"]),
                item.items[0].pos,
            )
    if forward is None:
        raise err(f"{kind} {name.name} has no (forward (x) ...)", form.pos)
    fargs, fbody = forward
    return LayerDef(name.name, kind, tuple(params), tuple(body), fargs, fbody, doc, name.pos)


def _forward(item: SList) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """``(forward (x) body...)``: its argument names and body."""
    if len(item.items) < 3 or not isinstance(item.items[1], SList):
        raise err("forward takes an argument list and a body: (forward (x) ...)", item.pos)
    args: list[str] = []
    for a in item.items[1].items:
        if not isinstance(a, Sym) or a.name in args:
            raise err(f"a forward argument must be a distinct name, got {show(a)}", a.pos)
        args.append(a.name)
    return tuple(args), tuple(item.items[2:])


def _body_item(item: SList, head: str, names: dict[str, Pos]) -> None:
    """Check a ``(param name ...)`` or ``(layer name ...)`` item's name, new in its layer."""
    if len(item.items) < 3 or not isinstance(item.items[1], Sym):
        raise err(f"{head} needs a name and a {'shape' if head == 'param' else 'layer'}", item.pos)
    n = item.items[1]
    if "." in n.name:
        raise err(f"a {head} name cannot contain '.': {n.name}", n.pos)
    if n.name in names:
        raise err(f"'{n.name}' is already declared at {names[n.name]}", n.pos)
    names[n.name] = n.pos

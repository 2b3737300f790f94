"""Top-level forms: reading sources and includes, ``defknob`` and ``defvariant``
(and settling knob values), ``deflayer``/``defmodel``, ``defdata`` and ``defrun``."""

from __future__ import annotations

import errno
import hashlib
import math
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from sexpgpu import graph as g
from sexpgpu.errors import Pos, UsageError
from sexpgpu.lang.reader import Atom, Kw, SList, Sym, read, show
from sexpgpu.lang.text import err, listing, suggest
from sexpgpu.lang.values import CORE_NAME, KnobDef, LayerDef

MAX_SOURCE_BYTES = 16 << 20
"""The largest `.sx` source ``include`` reads (docs/language.md); a larger one is refused."""


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


TOP_LEVEL = ("include", "defknob", "defvariant", "deflayer", "defmodel", "defdata", "defrun")


class FormsMixin:
    """The compiler's reading of sources and their top-level definitions."""

    def load(self, text: str, file: str, name: str, path: str | None, data: bytes) -> None:
        """Read one source and collect its top-level forms (includes recursively)."""
        self.sources.append(g.Source(name, path, hashlib.sha256(data).hexdigest()))
        for form in read(text, file):
            self.toplevel(form, file, name == CORE_NAME)

    def toplevel(self, form: Any, file: str, core: bool) -> None:
        """Collect one top-level form by its head."""
        if not isinstance(form, SList) or not form.items or not isinstance(form.items[0], Sym):
            raise err(f"expected a top-level form such as (defrun ...), got {show(form)}", form.pos)
        head = form.items[0]
        handler = {
            "include": self.form_include,
            "defknob": self.form_defknob,
            "defvariant": self.form_defvariant,
            "deflayer": self.form_deflayer,
            "defmodel": self.form_deflayer,
            "defdata": self.form_defdata,
            "defrun": self.form_defrun,
        }.get(head.name)
        if handler is None:
            raise err(
                f"unknown top-level form '{head.name}'"
                + suggest(
                    head.name,
                    [
                        "include",
                        "defknob",
                        "defvariant",
                        "deflayer",
                        "defmodel",
                        "defdata",
                        "defrun",
                    ],
                ),
                head.pos,
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
        if resolved in self.read_paths:
            return  # each file is read once; a cycle of includes ends here
        try:
            data = read_source_file(resolved)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise err(f"cannot read '{rel}': {reason}", form.items[1].pos) from None
        self.read_paths.add(resolved)
        name = os.path.relpath(resolved, os.path.realpath(self.base_dir)).replace(os.sep, "/")
        self.load(text, shown, name, resolved, data)

    def _name(self, form: SList, index: int, what: str) -> Sym:
        if len(form.items) <= index or not isinstance(form.items[index], Sym):
            raise err(f"{show(form.items[0])} needs a {what} name", form.pos)
        return form.items[index]

    def form_defknob(self, form: SList, file: str, core: bool) -> None:
        """``(defknob name default "doc")``."""
        name = self._name(form, 1, "knob")
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
        self.knobs[name.name] = KnobDef(name.name, v, kind, doc, name.pos, v, "default")

    def form_defvariant(self, form: SList, file: str, core: bool) -> None:
        """``(defvariant name "doc" :knob value ...)``."""
        name = self._name(form, 1, "variant")
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
                f"variant '{name.name}' is already defined at {self.variants[name.name][0]}",
                name.pos,
            )
        self.variants[name.name] = (name.pos, settings)

    def form_deflayer(self, form: SList, file: str, core: bool) -> None:
        """``(deflayer name (params) "doc" (param ...) (layer ...) (forward (x) ...))``."""
        kind = form.items[0].name
        name = self._name(form, 1, "layer" if kind == "deflayer" else "model")
        if len(form.items) < 3 or not isinstance(form.items[2], SList):
            raise err(
                f"{kind} {name.name} needs a parameter list, e.g. ({kind} {name.name} (dim) ...)",
                form.pos,
            )
        params = []
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
        fargs: tuple[str, ...] | None = None
        fbody: tuple[Any, ...] = ()
        names: dict[str, Pos] = {}
        for item in items:
            if not isinstance(item, SList) or not item.items or not isinstance(item.items[0], Sym):
                raise err(
                    f"expected (param ...), (layer ...) or (forward ...) in {name.name}, got {show(item)}",
                    item.pos,
                )
            head = item.items[0].name
            if head == "forward":
                if fargs is not None:
                    raise err(f"{name.name} has a second forward", item.pos)
                if len(item.items) < 3 or not isinstance(item.items[1], SList):
                    raise err(
                        "forward takes an argument list and a body: (forward (x) ...)", item.pos
                    )
                args = []
                for a in item.items[1].items:
                    if not isinstance(a, Sym) or a.name in args:
                        raise err(
                            f"a forward argument must be a distinct name, got {show(a)}", a.pos
                        )
                    args.append(a.name)
                fargs, fbody = tuple(args), tuple(item.items[2:])
            elif head in ("param", "layer"):
                if len(item.items) < 3 or not isinstance(item.items[1], Sym):
                    raise err(
                        f"{head} needs a name and a {'shape' if head == 'param' else 'layer'}",
                        item.pos,
                    )
                n = item.items[1]
                if "." in n.name:
                    raise err(f"a {head} name cannot contain '.': {n.name}", n.pos)
                if n.name in names:
                    raise err(f"'{n.name}' is already declared at {names[n.name]}", n.pos)
                names[n.name] = n.pos
                body.append(item)
            else:
                raise err(
                    f"unknown item '{head}' in {kind} {name.name}"
                    + suggest(head, ["param", "layer", "forward"]),
                    item.items[0].pos,
                )
        if fargs is None:
            raise err(f"{kind} {name.name} has no (forward (x) ...)", form.pos)
        ldef = LayerDef(name.name, kind, tuple(params), tuple(body), fargs, fbody, doc, name.pos)
        # the prelude's layers live apart, so a user's `linear` never changes `<core>`'s mlp
        table = self.core_layers if core else self.layers
        if name.name in table:
            raise err(f"layer '{name.name}' is already defined at {table[name.name].pos}", name.pos)
        table[name.name] = ldef

    def form_defdata(self, form: SList, file: str, core: bool) -> None:
        """``(defdata name (source :option value) :seq N :batch N)``, read when a run names it."""
        name = self._name(form, 1, "data")
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
        """``(defrun name :option value ...)``, read once every definition is known."""
        self._name(form, 1, "run")
        if self.runs:
            raise err(f"a program has one defrun; the first is at {self.runs[0].pos}", form.pos)
        self.runs.append(form)

    def settle_knobs(self, sets: Mapping[str, str], variant: str | None, steps: int | None) -> None:
        """Apply a variant, then ``--set`` values, then ``--steps``; record each knob's source."""
        # every variant is checked, chosen or not, so a typo shows up on the first check
        for _, settings in self.variants.values():
            for kw, node in settings:
                self._knob_value_from_node(self._knob_for(kw.name, kw.pos), node)
        if variant is not None:
            if variant not in self.variants:
                raise UsageError(
                    f"unknown variant '{variant}'{suggest(variant, self.variants)}; variants: {listing(self.variants)}"
                )
            for kw, node in self.variants[variant][1]:
                knob = self._knob_for(kw.name, kw.pos)
                knob.value = self._knob_value_from_node(knob, node)
                knob.source = "variant"
        for key, text in sets.items():
            if key not in self.knobs:
                raise UsageError(
                    f"--set {key}: unknown knob{suggest(key, self.knobs)}; knobs: {listing(self.knobs)}"
                )
            knob = self.knobs[key]
            knob.value = _parse_knob_text(knob, text)
            knob.source = "command line"
        if steps is not None:
            if "steps" not in self.knobs:
                raise UsageError(
                    "--steps sets the knob 'steps', and this file has none: add (defknob steps 100)"
                    f" and use :steps steps; knobs: {listing(self.knobs)}"
                )
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise UsageError(f"--steps must be a positive integer, got {steps!r}")
            knob = self.knobs["steps"]
            knob.value = _parse_knob_text(knob, str(steps))
            knob.source = "command line"

    def _knob_for(self, name: str, pos: Pos) -> KnobDef:
        if name not in self.knobs:
            raise err(
                f"unknown knob '{name}'{suggest(name, self.knobs)}; knobs: {listing(self.knobs)}",
                pos,
            )
        return self.knobs[name]

    def _knob_value_from_node(self, knob: KnobDef, node: Any) -> Any:
        if isinstance(node, Sym) and knob.kind == "symbol":
            return node.name
        if isinstance(node, Atom):
            v = node.value
            if knob.kind == "float" and isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            if (
                (knob.kind == "int" and type(v) is int)
                or (knob.kind == "bool" and isinstance(v, bool))
                or (knob.kind == "str" and isinstance(v, str))
            ):
                return v
        raise err(f"knob '{knob.name}' takes {_kind_text(knob)}, got {show(node)}", node.pos)


def _kind_text(knob: KnobDef) -> str:
    return {
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
        "str": "a string",
        "symbol": "a name",
    }[knob.kind]


def _parse_knob_text(knob: KnobDef, text: str) -> Any:
    """A ``--set`` value, typed by the knob's default."""
    kind = knob.kind
    try:
        if kind == "int":
            return int(text.strip(), 10)
        if kind == "float":
            v = float(text)
            if not math.isfinite(v):
                raise ValueError(text)
            return v
        if kind == "bool":
            low = text.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        if kind == "symbol":
            if not re.fullmatch(r"[^\s()\[\]\";:][^\s()\[\]\";]*", text):
                raise ValueError(text)
            return text
        return text
    except ValueError:
        raise UsageError(
            f"--set {knob.name}={text}: knob '{knob.name}' takes {_kind_text(knob)}"
            f" (its default is {_show_value(knob.default)})"
        ) from None


def _show_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, str) else str(v)

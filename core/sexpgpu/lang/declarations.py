"""What a run names from the catalog: ``defdata`` declarations checked against their
data source, optimizers and their schedules, and the eval metrics plugins supply."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import PluginError, Pos, SexpError, SourceError
from sexpgpu.lang import ir as g
from sexpgpu.lang.reader import SList, Sym, show
from sexpgpu.lang.static import Statics
from sexpgpu.lang.syntax import (
    FileCheck,
    checked_location,
    pick_keywords,
    relative_to_file,
    split_args,
)
from sexpgpu.lang.text import describe, err, listing, suggest

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

__all__ = ["E_NO_EVAL", "Declarations"]

E_NO_EVAL = "E-EVAL-001"
"""A run with ``:evals`` where no available plugin runs eval passes."""


class Declarations:
    """Declarations read against ``catalog``, their values known by ``statics``;
    each ``defdata`` of ``datas`` is declared once, however often it is named."""

    def __init__(
        self,
        datas: Mapping[str, SList],
        statics: Statics,
        catalog: Catalog,
        *,
        check_files: bool = True,
        files: FileCheck | None = None,
    ) -> None:
        self._datas = datas
        self.statics = statics
        self.catalog = catalog
        self._check_files = check_files
        self._files = files
        self._data_decls: dict[str, g.DataDecl] = {}

    def _descriptor(self, hook: str, what: str, name: str, pos: Pos) -> Any:
        try:
            return self.catalog.named(hook, what, name)
        except PluginError as exc:
            raise SourceError(exc.message, code=exc.code, pos=pos) from None

    def data_decl(self, name_node: Any) -> g.DataDecl:
        """The ``defdata`` named by ``name_node``, checked against its data source's options."""
        if not isinstance(name_node, Sym):
            raise err(f":data names a defdata, got {show(name_node)}", name_node.pos)
        name = name_node.name
        if name not in self._datas:
            raise err(
                f"unknown data '{name}'{suggest(name, self._datas)}; defdata: {listing(self._datas)}",
                name_node.pos,
            )
        if name in self._data_decls:
            return self._data_decls[name]
        form = self._datas[name]
        src = form.items[2]
        if isinstance(src, Sym):
            src = SList((src,), src.pos)
        if not isinstance(src, SList) or not src.items or not isinstance(src.items[0], Sym):
            raise err(f"a data source is (name :option value ...), got {show(src)}", src.pos)
        sname = src.items[0]
        info = self._descriptor("sexpgpu_data_sources", "data source", sname.name, sname.pos)
        positional, keywords = split_args(src.items[1:])
        if positional:
            raise err(
                f"data source options are :name value pairs, got {show(positional[0])}",
                positional[0].pos,
            )
        options = dict(info.options)
        for kw, node in keywords:
            key = declared_option(kw.name, info.options)
            if key is None:
                valid = [":" + k.replace("_", "-") for k in info.options]
                raise err(
                    f"data source '{sname.name}' has no option :{kw.name}{suggest(':' + kw.name, valid)};"
                    f" its options: {', '.join(sorted(valid)) or 'none'}",
                    kw.pos,
                )
            options[key] = self.option_value(node, info.options[key], kw.name, {})
            if key in info.path_options:
                located = relative_to_file(options[key], node.pos)
                options[key] = checked_location(self._files, "data", located, node.pos)
        p3, run_kw = split_args(form.items[3:])
        if p3:
            raise err(
                f"defdata takes :seq and :batch after the source, got {show(p3[0])}", p3[0].pos
            )
        opts = pick_keywords(run_kw, ("seq", "batch"), "defdata")
        if "batch" not in opts:
            raise err(f"defdata {name} needs :batch", form.pos)
        seq = self.statics.int_of(opts["seq"], {}, ":seq", 1) if "seq" in opts else 0
        batch = self.statics.int_of(opts["batch"], {}, ":batch", 1)
        try:
            fields = dict(info.fields(options, seq, batch))
            if self._check_files and info.check is not None:
                info.check(options, seq, batch)
        except SexpError as exc:
            # keep the source's stable code (E-DATA-00x): the line names it for docs/errors.md
            raise SourceError(exc.message, code=exc.code, pos=exc.pos or src.pos) from None
        except Exception as exc:  # a data source's own complaint about its options
            raise err(f"data source '{sname.name}': {exc}", src.pos) from None
        decl = g.DataDecl(name, sname.name, options, seq, batch, fields, form.items[1].pos)
        self._data_decls[name] = decl
        return decl

    def option_value(self, node: Any, default: Any, what: str, env: Mapping[str, Any]) -> Any:
        """An option's value, checked against the kind of its default."""
        if isinstance(default, (tuple, list)):
            return self.statics.words(node, env, "names")
        v = self.statics.static(node, env)
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise err(f":{what} must be true or false, got {describe(v)}", node.pos)
        elif isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise err(f":{what} must be a number, got {describe(v)}", node.pos)
            v = float(v)
        elif isinstance(default, int):
            if isinstance(v, bool) or not isinstance(v, int):
                raise err(f":{what} must be an integer, got {describe(v)}", node.pos)
        elif isinstance(default, str) and not isinstance(v, str):
            raise err(f":{what} must be a string, got {describe(v)}", node.pos)
        return v

    def optimizer_decl(self, node: Any, base: g.OptimizerDecl | None) -> g.OptimizerDecl:
        """``(name :option value ... :schedule S :clip C)``; a stage's starts from ``base``."""
        if isinstance(node, Sym):
            node = SList((node,), node.pos)
        if not isinstance(node, SList) or not node.items or not isinstance(node.items[0], Sym):
            raise err(
                f"an optimizer is (name :option value ...), e.g. (adam :lr 0.001), got {show(node)}",
                node.pos,
            )
        name = node.items[0]
        info = self._descriptor("sexpgpu_optimizers", "optimizer", name.name, name.pos)
        positional, keywords = split_args(node.items[1:])
        if positional:
            raise err(
                f"optimizer options are :name value pairs, got {show(positional[0])}",
                positional[0].pos,
            )
        # a stage that names the same optimizer starts from the run's settings
        same = base is not None and base.name == name.name
        options = dict(base.options) if same else dict(info.options)
        schedule = base.schedule if same else g.Schedule()
        clip = base.clip if same else None
        seen: set[str] = set()
        for kw, v in keywords:
            if kw.name in seen:
                raise err(f":{kw.name} is given twice", kw.pos)
            seen.add(kw.name)
            if kw.name == "schedule":
                schedule = self.schedule_of(v)
                continue
            if kw.name == "clip":
                c = self.statics.static(v, {})
                if isinstance(c, bool) and not c:
                    clip = None
                elif isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0:
                    raise err(
                        f":clip is a positive global norm (or false), got {describe(c)}", v.pos
                    )
                else:
                    clip = float(c)
                continue
            key = declared_option(kw.name, info.options)
            if key is None:
                valid = [":" + k.replace("_", "-") for k in info.options] + [":schedule", ":clip"]
                raise err(
                    f"optimizer '{name.name}' has no option :{kw.name}{suggest(':' + kw.name, valid)};"
                    f" its options: {', '.join(sorted(valid))}",
                    kw.pos,
                )
            options[key] = self.option_value(v, info.options[key], kw.name, {})
        if options.get("lr") is None and "lr" in info.options:
            raise err(f"optimizer '{name.name}' needs :lr", node.pos)
        return g.OptimizerDecl(name.name, options, schedule, clip, node.pos)

    def schedule_of(self, node: Any) -> g.Schedule:
        """``constant``, ``(warmup :warmup N)`` or ``(cosine :warmup N :min-lr X)``."""
        if isinstance(node, Sym):
            node = SList((node,), node.pos)
        if not isinstance(node, SList) or not node.items or not isinstance(node.items[0], Sym):
            raise err(
                f"a schedule is constant, (warmup :warmup 10) or (cosine :warmup 10 :min-lr 0.0), got {show(node)}",
                node.pos,
            )
        kind = node.items[0]
        kinds = ("constant", "warmup", "cosine")
        if kind.name not in kinds:
            raise err(
                f"unknown schedule '{kind.name}'{suggest(kind.name, kinds)}; schedules: {listing(kinds)}",
                kind.pos,
            )
        positional, keywords = split_args(node.items[1:])
        if positional:
            raise err(
                f"schedule options are :name value pairs, got {show(positional[0])}",
                positional[0].pos,
            )
        allowed = {"constant": (), "warmup": ("warmup",), "cosine": ("warmup", "min-lr")}[kind.name]
        opts = pick_keywords(keywords, allowed, kind.name)
        warmup = self.statics.int_of(opts["warmup"], {}, ":warmup", 0) if "warmup" in opts else 0
        if kind.name == "warmup" and "warmup" not in opts:
            raise err("(warmup :warmup N) needs its number of steps", node.pos)
        min_lr = self.statics.num_of(opts["min-lr"], {}, ":min-lr") if "min-lr" in opts else 0.0
        return g.Schedule(kind.name, warmup, min_lr)

    def eval_metrics(self, pos: Pos) -> dict[str, Any]:
        """The eval metrics plugins supply, by name, each as (descriptor, its plugin), or
        as the error using it raises (two plugins supply it, or its plugin is
        unavailable); an error when no plugin can run a pass."""
        plugins = self.catalog
        if not plugins.available("sexpgpu_evaluators"):
            raise SourceError(
                f"eval passes (:evals) cannot run: {_no_evaluator(plugins)}",
                code=E_NO_EVAL,
                pos=pos,
            )
        hook = "sexpgpu_eval_metrics"
        found: dict[str, Any] = {}
        for info, record in plugins.supplied(hook):
            name = info.name
            try:
                chosen = plugins.require(
                    hook, f"the eval metric '{name}'", lambda i, name=name: i.name == name
                )
            except PluginError as exc:
                found[name] = exc
                continue
            if chosen is info:
                found[name] = (info, record.name)
        return found


def _no_evaluator(catalog: Catalog) -> str:
    """Why no plugin runs eval passes: the one that would is unavailable (its reason),
    or disabled, or none is installed."""
    unavailable = [r for _, r in catalog.supplied("sexpgpu_evaluators") if not r.available]
    if unavailable:
        record = unavailable[0]
        return f"the plugin '{record.name}' that supplies them is {record.state}: {record.reason}"
    disabled = [r.name for r in catalog.records if r.disabled]
    if disabled:
        return (
            "no available plugin supplies them, and SEXPGPU_DISABLE_PLUGINS disables "
            f"{listing(disabled)}"
        )
    return "no installed plugin supplies them (see `sexpgpu plugins`)"


def declared_option(written: str, options: Mapping[str, Any]) -> str | None:
    """The key of ``options`` (a plugin's defaults) that the option ``:written`` sets:
    a plugin may spell it with ``_`` or ``-`` (``weight_decay``, ``weight-decay``), and
    a `.sx` file writes ``:weight-decay``; ``None`` when it declares no such option."""
    wanted = written.replace("-", "_")
    return next((key for key in options if key.replace("-", "_") == wanted), None)

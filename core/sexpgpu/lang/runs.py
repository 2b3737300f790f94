"""Runs: data sources, optimizers and schedules looked up in the plugins, and
``defrun`` with its stages, eval passes and second roots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sexpgpu import graph as g
from sexpgpu.errors import PluginError, Pos, SexpError, SourceError
from sexpgpu.lang.ops import FLOATS
from sexpgpu.lang.reader import SList, SVec, Sym, show
from sexpgpu.lang.text import describe, err, listing, suggest
from sexpgpu.lang.values import (
    Builder,
    Ctx,
    Instance,
    T,
    named_form,
    pick_keywords,
    relative_to_file,
    split_args,
)

DEFRUN_OPTIONS = (
    "model",
    "data",
    "loss",
    "optimizer",
    "steps",
    "checkpoint-every",
    "keep-last",
    "seed",
    "precision",
    "counters",
    "guard-finite",
    "deterministic",
    "stages",
    "evals",
    "with-loaded",
)
COUNTERS = ("tokens", "records")
E_NO_EVAL = "E-EVAL-001"
"""A run with ``:evals`` where no available plugin runs eval passes."""


def _symbols(node: Any) -> set[str]:
    """Every symbol named anywhere in ``node``."""
    if isinstance(node, Sym):
        return {node.name}
    items = getattr(node, "items", None) or ()
    return set().union(*(_symbols(item) for item in items)) if items else set()


class RunsMixin:
    """The compiler's reading of ``defrun`` and what it names."""

    def plugins(self) -> Any:
        """The catalog compiled against (asked for data sources, optimizers, ops and
        storage schemes)."""
        return self.catalog

    def _descriptor(self, hook: str, what: str, name: str, pos: Pos) -> Any:
        plugins = self.plugins()
        known = sorted({item.name for item, _ in plugins.supplied(hook)})
        if name not in known:
            raise err(
                f"unknown {what} '{name}'{suggest(name, known)}; {what}s: {listing(known)}", pos
            )
        try:
            return plugins.require(hook, f"the {what} '{name}'", lambda i: i.name == name)
        except PluginError as exc:
            raise err(exc.message, pos) from None

    def data_decl(self, name_node: Any) -> g.DataDecl:
        """The ``defdata`` named by ``name_node``, checked against its data source's options."""
        if not isinstance(name_node, Sym):
            raise err(f":data names a defdata, got {show(name_node)}", name_node.pos)
        name = name_node.name
        if name not in self.datas:
            raise err(
                f"unknown data '{name}'{suggest(name, self.datas)}; defdata: {listing(self.datas)}",
                name_node.pos,
            )
        if name in self.data_decls:
            return self.data_decls[name]
        form = self.datas[name]
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
            key = kw.name.replace("-", "_")
            if key not in info.options:
                valid = [":" + k.replace("_", "-") for k in info.options]
                raise err(
                    f"data source '{sname.name}' has no option :{kw.name}{suggest(':' + kw.name, valid)};"
                    f" its options: {', '.join(sorted(valid)) or 'none'}",
                    kw.pos,
                )
            options[key] = self.option_value(node, info.options[key], kw.name, {})
            if key in getattr(info, "path_options", ()):
                options[key] = relative_to_file(options[key], node.pos)
        _, run_kw = split_args(form.items[3:])
        p3, _ = split_args(form.items[3:])
        if p3:
            raise err(
                f"defdata takes :seq and :batch after the source, got {show(p3[0])}", p3[0].pos
            )
        opts = pick_keywords(run_kw, ("seq", "batch"), "defdata")
        if "batch" not in opts:
            raise err(f"defdata {name} needs :batch", form.pos)
        seq = self.int_of(opts["seq"], {}, ":seq", 1) if "seq" in opts else 0
        batch = self.int_of(opts["batch"], {}, ":batch", 1)
        try:
            fields = dict(info.fields(options, seq, batch))
        except SexpError as exc:
            # keep the source's stable code (E-DATA-00x): the line names it for docs/errors.md
            raise SourceError(exc.message, code=exc.code, pos=exc.pos or src.pos) from None
        except Exception as exc:  # a data source's own complaint about its options
            raise err(f"data source '{sname.name}': {exc}", src.pos) from None
        decl = g.DataDecl(name, sname.name, options, seq, batch, fields, form.items[1].pos)
        self.data_decls[name] = decl
        return decl

    def option_value(self, node: Any, default: Any, what: str, env: Mapping[str, Any]) -> Any:
        """An option's value, checked against the kind of its default."""
        if isinstance(default, (tuple, list)):
            return self.words(node, env, "names")
        v = self.static(node, env)
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
                c = self.static(v, {})
                if isinstance(c, bool) and not c:
                    clip = None
                elif isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0:
                    raise err(
                        f":clip is a positive global norm (or false), got {describe(c)}", v.pos
                    )
                else:
                    clip = float(c)
                continue
            key = kw.name.replace("-", "_")
            if key not in info.options:
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
        warmup = self.int_of(opts["warmup"], {}, ":warmup", 0) if "warmup" in opts else 0
        if kind.name == "warmup" and "warmup" not in opts:
            raise err("(warmup :warmup N) needs its number of steps", node.pos)
        min_lr = self.num_of(opts["min-lr"], {}, ":min-lr") if "min-lr" in opts else 0.0
        return g.Schedule(kind.name, warmup, min_lr)

    def build(self, file: str, variant: str | None) -> g.Program:
        """The checked program of the ``defrun`` (there must be one)."""
        if not self.runs:
            raise err("no (defrun ...) in this program", Pos(file, 1, 1))
        form = self.runs[0]
        positional, keywords = split_args(form.items[2:])
        if positional:
            raise err(
                f"defrun takes :keyword value pairs, got {show(positional[0])}", positional[0].pos
            )
        opts = pick_keywords(keywords, DEFRUN_OPTIONS, "defrun")
        roots = self.roots(form, opts)
        settings = self.run_settings(form.items[1].name, opts)
        base_opt = self.optimizer_decl(opts["optimizer"], None) if "optimizer" in opts else None
        loss_node = opts.get("loss")
        stages = self.stages(form, opts, base_opt, loss_node, roots)
        if loss_node is None and self.stage_losses:
            loss_node = self.stage_losses[0]  # an eval's `loss` is the first stage's then
        evals = self.evals(opts, stages[0].data, loss_node, roots)
        knobs = tuple(
            g.Knob(k.name, k.value, k.default, k.source, k.doc) for k in self.knobs.values()
        )
        return g.Program(
            file=file,
            sources=tuple(self.sources),
            knobs=knobs,
            variant=variant,
            params=tuple(self.params),
            run=settings,
            stages=tuple(stages),
            evals=tuple(evals),
            sites=tuple(self.sites.values()),
        )

    def roots(self, form: SList, opts: Mapping[str, Any]) -> dict[str, Instance]:
        """``model`` and the second root of ``:with-loaded``, instantiated."""
        if "model" not in opts:
            raise err("defrun needs :model, e.g. :model (net 32 8)", form.pos)
        model = self.instantiate(opts["model"], "model", {}, (), {})
        if not isinstance(model, Instance):
            raise err(":model is a layer such as (net 32 8), not a repeat", opts["model"].pos)
        roots = {"model": model}
        if "with-loaded" in opts:
            name, inst = self.with_loaded(opts["with-loaded"], roots)
            roots[name] = inst
        return roots

    def run_settings(self, run_name: str, opts: Mapping[str, Any]) -> g.RunSettings:
        """The run's seed, precision, counters, guard, determinism and checkpoint interval."""
        env: dict[str, Any] = {}
        seed = self.int_of(opts["seed"], env, ":seed", 0) if "seed" in opts else 0
        precision = "f32"
        if "precision" in opts:
            precision = self.word(opts["precision"], env, "a precision")
            if precision not in FLOATS:
                raise err(f":precision is f32 or bf16, got {precision}", opts["precision"].pos)
        counters = self.counters(opts["counters"]) if "counters" in opts else ()
        guard = (
            self.bool_of(opts["guard-finite"], env, ":guard-finite")
            if "guard-finite" in opts
            else False
        )
        deterministic = (
            self.bool_of(opts["deterministic"], env, ":deterministic")
            if "deterministic" in opts
            else True
        )
        every = (
            self.int_of(opts["checkpoint-every"], env, ":checkpoint-every", 1)
            if "checkpoint-every" in opts
            else None
        )
        # Retention: how many complete checkpoints to keep (None keeps them all).
        keep = self.int_of(opts["keep-last"], env, ":keep-last", 1) if "keep-last" in opts else None
        return g.RunSettings(
            run_name, every, seed, precision, counters, guard, deterministic, keep_last=keep
        )

    def counters(self, node: Any) -> tuple[str, ...]:
        """``:counters (tokens records)``: known counters, each once."""
        counters = self.words(node, {}, "counters")
        for c, n in zip(counters, node.items, strict=True):
            if c not in COUNTERS:
                raise err(
                    f"unknown counter '{c}'{suggest(c, COUNTERS)}; counters: records, tokens",
                    n.pos,
                )
        if len(set(counters)) != len(counters):
            raise err("a counter is listed twice", node.pos)
        return counters

    def stages(
        self,
        form: SList,
        opts: Mapping[str, Any],
        base_opt: g.OptimizerDecl | None,
        loss_node: Any,
        roots: Mapping[str, Instance],
    ) -> list[g.Stage]:
        """The run's ``:stages``, or its one stage ``main``."""
        if "stages" in opts:
            if "steps" in opts:
                raise err(
                    "with :stages, each stage has its own :steps; remove the run's :steps",
                    opts["steps"].pos,
                )
            node = opts["stages"]
            if not isinstance(node, (SList, SVec)) or not node.items:
                raise err(
                    "(:stages ((stage warm :steps 10 ...) ...)) lists one or more stages", node.pos
                )
            names: set[str] = set()
            return [self.stage(s, opts, base_opt, loss_node, roots, names) for s in node.items]
        if "steps" not in opts:
            raise err("defrun needs :steps", form.pos)
        steps = self.int_of(opts["steps"], {}, ":steps", 1)
        if "data" not in opts:
            raise err("defrun needs :data naming a defdata", form.pos)
        if base_opt is None:
            raise err("defrun needs :optimizer, e.g. :optimizer (adam :lr 0.001)", form.pos)
        if loss_node is None:
            raise err(
                "defrun needs :loss, e.g. :loss (cross-entropy (model inputs) targets)", form.pos
            )
        data = self.data_decl(opts["data"])
        return [g.Stage("main", steps, data, base_opt, self.loss_graph(loss_node, data, roots))]

    def evals(
        self,
        opts: Mapping[str, Any],
        data: g.DataDecl,
        loss_node: Any,
        roots: Mapping[str, Instance],
    ) -> list[g.EvalPass]:
        """The run's ``:evals``; ``data`` is the first stage's, their default."""
        evals: list[g.EvalPass] = []
        if "evals" in opts:
            node = opts["evals"]
            if not isinstance(node, (SList, SVec)):
                raise err("(:evals ((eval probe :every 50 ...) ...)) lists eval passes", node.pos)
            for eform in node.items:
                evals.append(self.eval_pass(eform, data, loss_node, roots, {e.name for e in evals}))
        return evals

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
        uri = self.static(opts["file"], {})
        if not isinstance(uri, str):
            raise err(":file is a string", opts["file"].pos)
        uri = self.check_uri(uri, opts["file"].pos)
        template = "{path}"
        if "names" in opts:
            template = self.static(opts["names"], {})
            if not isinstance(template, str) or (
                "{path}" not in template and "{name}" not in template
            ):
                raise err(
                    ':names maps a parameter to its tensor with {path} (teacher.ff.up) or {name} (ff.up), e.g. "{path}.weight"',
                    opts["names"].pos,
                )
        inst = self.instantiate(node.items[1], name.name, {}, (), {"loaded": (uri, template)})
        if not isinstance(inst, Instance):
            raise err(
                "a second root is a layer such as (net 32 8), not a repeat", node.items[1].pos
            )
        return name.name, inst

    def stage(
        self,
        sform: Any,
        opts: Mapping[str, Any],
        base_opt: g.OptimizerDecl | None,
        loss_node: Any,
        roots: Mapping[str, Instance],
        names: set[str],
    ) -> g.Stage:
        """One ``(stage name :steps N ...)``; what it leaves out is the run's."""
        name, s = named_form(
            sform,
            "stage",
            "(stage name :steps N ...)",
            names,
            ("steps", "data", "optimizer", "loss"),
        )
        sname = name.name
        if "steps" not in s:
            raise err(f"stage {sname} needs :steps", sform.pos)
        steps = self.int_of(s["steps"], {}, ":steps", 1)
        data_node = s.get("data", opts.get("data"))
        if data_node is None:
            raise err(f"stage {sname} needs :data (or give the run :data)", sform.pos)
        optimizer = self.optimizer_decl(s["optimizer"], base_opt) if "optimizer" in s else base_opt
        if optimizer is None:
            raise err(f"stage {sname} needs :optimizer (or give the run :optimizer)", sform.pos)
        lnode = s.get("loss", loss_node)
        if lnode is None:
            raise err(f"stage {sname} needs :loss (or give the run :loss)", sform.pos)
        data = self.data_decl(data_node)
        self.stage_losses.append(lnode)
        return g.Stage(sname, steps, data, optimizer, self.loss_graph(lnode, data, roots))

    def loss_graph(self, node: Any, data: g.DataDecl, roots: Mapping[str, Instance]) -> g.Graph:
        """The graph of a loss expression on ``data``'s fields."""
        b = Builder(self)
        out = self.scalar(node, "the loss", Ctx(b, None, {}, data.fields, roots))
        return b.graph([out])

    def scalar(self, node: Any, what: str, ctx: Ctx) -> T:
        """``node`` compiled to an ``f32`` scalar (``what`` names it in errors)."""
        v = self.expr(node, ctx)
        if not isinstance(v, T):
            raise err(f"{what} must be a tensor expression, got {describe(v)}", node.pos)
        if v.type.shape != ():
            raise err(
                f"{what} must be a scalar, got {v.type}; reduce it, e.g. (mean ...)", node.pos
            )
        if v.type.dtype != "f32":
            if v.type.dtype not in FLOATS:
                raise err(f"{what} must be floating, got {v.type}", node.pos)
            v = ctx.b.add("cast", [v], {"dtype": "f32"}, node.pos)
        return v

    def eval_pass(
        self,
        form: Any,
        default_data: g.DataDecl,
        loss_node: Any,
        roots: Mapping[str, Instance],
        taken: set[str],
    ) -> g.EvalPass:
        """One ``(eval name :every N :data d :batches N :metrics (...))``."""
        name, e = named_form(
            form,
            "eval",
            "(eval name :every N :data d :metrics (loss))",
            taken,
            ("every", "data", "batches", "metrics"),
        )
        if "every" not in e:
            raise err(f"eval {name.name} needs :every N (steps between passes)", form.pos)
        every = self.int_of(e["every"], {}, ":every", 1)
        batches = self.int_of(e["batches"], {}, ":batches", 1) if "batches" in e else 1
        data = self.data_decl(e["data"]) if "data" in e else default_data
        metric_nodes: list[Any] = [Sym("loss", form.pos)]
        if "metrics" in e:
            m = e["metrics"]
            if not isinstance(m, (SList, SVec)) or not m.items:
                raise err("(:metrics (loss accuracy)) lists one or more metrics", m.pos)
            metric_nodes = list(m.items)
        metrics = self.eval_metrics(form.pos)
        b = Builder(self)
        ctx = Ctx(b, None, {}, data.fields, roots)
        names: list[str] = []
        outs: list[T] = []
        for mn in metric_nodes:
            if isinstance(mn, Sym) and mn.name in metrics:
                mname = mn.name
                out = self.metric_value(metrics[mname], mn.pos, data, loss_node, ctx)
            elif isinstance(mn, SList) and len(mn.items) == 2 and isinstance(mn.items[0], Sym):
                mname = mn.items[0].name
                if mname in metrics:
                    # a registered metric's number is finished its own way (perplexity: exp)
                    raise err(f"'{mname}' is the name of a metric; name yours otherwise", mn.pos)
                out = self.scalar(mn.items[1], f"the metric {mname}", ctx)
            else:
                hint = suggest(mn.name, metrics) if isinstance(mn, Sym) else ""
                raise err(
                    f"unknown metric {show(mn)}{hint}: a metric is one of "
                    f"{listing(metrics)}, or (name expression)",
                    mn.pos,
                )
            if mname in names:
                raise err(f"metric '{mname}' is listed twice", mn.pos)
            names.append(mname)
            outs.append(out)
        return g.EvalPass(name.name, every, data, batches, tuple(names), b.graph(outs))

    def eval_metrics(self, pos: Pos) -> dict[str, Any]:
        """The eval metrics plugins supply, by name; an error when no plugin can run a pass."""
        plugins = self.plugins()
        if not plugins.available("sexpgpu_evaluators"):
            raise SourceError(
                f"eval passes (:evals) cannot run: {_no_evaluator(plugins)}",
                code=E_NO_EVAL,
                pos=pos,
            )
        return {info.name: info for info in plugins.available("sexpgpu_eval_metrics")}

    def metric_value(self, info: Any, pos: Pos, data: g.DataDecl, loss_node: Any, ctx: Ctx) -> T:
        """A registered metric's per-batch scalar: its expression compiled with ``logits``
        (the model on ``inputs``) and ``loss`` (the run's) bound when it names them."""
        from sexpgpu.lang.reader import read

        forms = read(info.expression, f"<metric {info.name}>")
        if len(forms) != 1:
            raise err(f"the metric {info.name}'s expression is not one expression", pos)
        used = _symbols(forms[0])
        bound: dict[str, Any] = {}
        if "loss" in used:
            if loss_node is None:
                raise err(f"the metric {info.name} needs the run's :loss", pos)
            bound["loss"] = self.scalar(loss_node, "the loss", ctx)
        for needed in ("inputs", "targets") if "logits" in used else ():
            if needed not in data.fields:
                raise err(
                    f"the metric {info.name} compares (model inputs) with targets; "
                    f"data '{data.name}' has no field {needed}",
                    pos,
                )
        if "logits" in used:
            inputs = ctx.b.input("inputs", data.fields["inputs"], pos)
            logits = self.call_layer(ctx.roots["model"], [inputs], pos, ctx)
            if not isinstance(logits, T):
                raise err(
                    f"the metric {info.name} needs the model to give logits, got {describe(logits)}",
                    pos,
                )
            bound["logits"] = logits
        local = Ctx(ctx.b, None, bound, ctx.fields, ctx.roots)
        return self.scalar(forms[0], f"the metric {info.name}", local)


def _no_evaluator(catalog: Any) -> str:
    """Why no plugin runs eval passes: the one that would is unavailable (its reason),
    or disabled, or none is installed."""
    unavailable = [r for _, r in catalog.supplied("sexpgpu_evaluators") if not r.available]
    if unavailable:
        record = unavailable[0]
        return f"the plugin '{record.name}' that supplies them is unavailable: {record.reason}"
    disabled = [r.name for r in catalog.records if r.disabled]
    if disabled:
        return (
            "no available plugin supplies them, and SEXPGPU_DISABLE_PLUGINS disables "
            f"{listing(disabled)}"
        )
    return "no installed plugin supplies them (see `sexpgpu plugins`)"

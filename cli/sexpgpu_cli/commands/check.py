"""``sexpgpu check`` and ``sexpgpu compile``: compile a `.sx` file and show what it holds.

Neither imports torch: compiling checks every shape without making a tensor.
"""

from __future__ import annotations

import math
from typing import Any

import click

from sexpgpu_cli.group import catalog
from sexpgpu_cli.options import parse_sets


def _compile(file: str, sets: tuple[str, ...], variant: str | None, steps: int | None):
    from sexpgpu.lang import compile_file

    return compile_file(
        file, catalog=catalog(), sets=parse_sets(sets), variant=variant, steps=steps
    )


def _selection(f):
    f = click.option("--steps", type=int, default=None, help="Set the knob `steps`.")(f)
    f = click.option("--variant", default=None, metavar="NAME", help="Apply a defvariant.")(f)
    f = click.option(
        "--set", "sets", multiple=True, metavar="NAME=VALUE", help="Set a knob (repeatable)."
    )(f)
    return click.argument("file", type=click.Path(dir_okay=False))(f)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


@click.command("check")
@_selection
def check(file: str, sets: tuple[str, ...], variant: str | None, steps: int | None) -> None:
    """Compile FILE, check every shape and every :load tensor (headers only), and
    list its choice sites with the kernels for each, and its parameters."""
    from sexpgpu.checkpoint.loads import Loads

    program = _compile(file, sets, variant, steps)
    Loads.of(program, catalog().open_location).check()
    rows = [
        (
            p.path,
            _shape(p.type.shape),
            p.type.dtype,
            "trainable" if p.trainable else "frozen",
            ",".join(p.tags) or "-",
            (f"load {p.load.tensor} from {p.load.uri}" if p.load else ""),
        )
        for p in program.params
    ]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(5)]
    click.echo(
        f"{program.file}: run {program.run.name}, {program.steps} steps, variant {program.variant or '-'}"
    )
    if program.sites:
        for line in _site_lines(program):
            click.echo(line)
        click.echo("parameters:")
    for r in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True))
        click.echo(("  " + line + ("  " + r[5] if r[5] else "")).rstrip())
    total = sum(math.prod(p.type.shape) for p in program.params)
    trainable = sum(math.prod(p.type.shape) for p in program.params if p.trainable)
    click.echo(f"{len(program.params)} parameters, {total:,} values ({trainable:,} trainable)")


def _site_lines(program: Any) -> list[str]:
    """The choice sites by kind, each kind with the available kernels of that kind:
    what ``sexpgpu run --choose`` can name."""
    from sexpgpu.kernels import rank

    kernels = sorted(catalog().kernels(), key=lambda k: (k.lowering, rank(k)))
    deterministic = program.run.deterministic
    lines = [
        "choice sites (sexpgpu run --choose SITE=KERNEL, or KIND=KERNEL for all of a kind; "
        "a run takes one that its lowering can call on its device):"
    ]
    for kind in sorted({site.kind for site in program.sites}):
        sites = [site.name for site in program.sites if site.kind == kind]
        lines.append(f"  {kind}: {', '.join(sites)}")
        rows = [
            (
                k.name,
                f"{k.lowering} lowering",
                "on " + ", ".join(k.devices),
                "deterministic"
                if k.deterministic
                else "non-deterministic" + (" (:deterministic false)" if deterministic else ""),
                f"priority {k.priority}",
            )
            for k in kernels
            if k.kind == kind
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else []
        lines += [
            "    " + "  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)), r[4]])
            for r in rows
        ]
        if not rows:
            lines.append("    no kernel is installed for this kind (see `sexpgpu plugins`)")
    return lines


SHOW = ("graph", "params", "knobs", "sources", "sites", "all")


@click.command("compile")
@_selection
@click.option(
    "--show",
    "show",
    type=click.Choice(SHOW),
    default="graph",
    show_default=True,
    help="What to print.",
)
def compile_(
    file: str, sets: tuple[str, ...], variant: str | None, steps: int | None, show: str
) -> None:
    """Compile FILE and print the compiled program (graphs, params, knobs...)."""
    program = _compile(file, sets, variant, steps)
    parts = SHOW[:-1] if show == "all" else (show,)
    for part in parts:
        if show == "all":
            click.echo(f"== {part}")
        for line in _render(program, part):
            click.echo(line)


def _render(program: Any, part: str) -> list[str]:
    if part == "params":
        return [
            f"{p.path}  {p.type}  {'trainable' if p.trainable else 'frozen'}"
            f"  init {p.init.kind}{list(p.init.args) if p.init.args else ''}"
            + (f"  tags {','.join(p.tags)}" if p.tags else "")
            + (f"  load {p.load.tensor} from {p.load.uri}" if p.load else "")
            for p in program.params
        ]
    if part == "knobs":
        return [
            f"{k.name} = {k.value!r}  ({k.source}; default {k.default!r})" for k in program.knobs
        ]
    if part == "sources":
        return [f"{s.name}  {s.sha256}  {s.path or ''}".rstrip() for s in program.sources]
    if part == "sites":
        return [f"{s.name}  {s.kind}  {s.pos}" for s in program.sites]
    out: list[str] = []
    for stage in program.stages:
        o = stage.optimizer
        out.append(
            f"stage {stage.name}: {stage.steps} steps on {stage.data.name}"
            f" ({stage.data.source}, batch {stage.data.batch}, seq {stage.data.seq});"
            f" optimizer {o.name} {dict(o.options)} schedule {o.schedule.kind}"
            + (f" clip {o.clip}" if o.clip is not None else "")
        )
        out += _generator_lines(stage.generator)
        out += _graph_lines(stage.loss, "  ")
        out.append(f"  -> loss %{stage.loss.outputs[0]}")
    for ev in program.evals:
        out.append(
            f"eval {ev.name}: every {ev.every} steps, {ev.batches} batches of {ev.data.name}"
        )
        out += _generator_lines(ev.generator)
        out += _graph_lines(ev.graph, "  ")
        out.append(
            "  -> "
            + ", ".join(f"{m} %{i}" for m, i in zip(ev.metrics, ev.graph.outputs, strict=True))
        )
    return out


def _generator_lines(gen: Any) -> list[str]:
    """A generator's options, its logits graph and its reward graph (docs/generate.md)."""
    if gen is None:
        return []
    records = gen.fields["reward"].shape[0]
    lines = [
        f"  generate from {gen.root}: {gen.new_tokens} new tokens after a prompt of "
        f"{gen.prompt_length}, {gen.samples} samples per prompt ({records} records),"
        f" temperature {gen.temperature} top-k {gen.top_k} top-p {gen.top_p} stop {gen.stop}"
        f"; reward {'the data source verifies' if gen.reward is None else 'below'}"
    ]
    lines += _graph_lines(gen.logits, "    ")
    lines.append(f"    -> logits %{gen.logits.outputs[0]}")
    if gen.reward is not None:
        lines += _graph_lines(gen.reward, "    ")
        lines.append(f"    -> reward %{gen.reward.outputs[0]}")
    return lines


def _graph_lines(graph: Any, indent: str) -> list[str]:
    lines = []
    for n in graph.nodes:
        attrs = " ".join(f":{k} {v}" for k, v in n.attrs.items() if k not in ("body", "slots"))
        args = " ".join(f"%{a}" for a in n.args)
        text = " ".join(x for x in (n.op, args, attrs) if x)
        site = f"  [{n.site}]" if n.site else ""
        lines.append(f"{indent}%{n.id} = {text} : {n.type}{site}")
        if n.op == "repeat":
            body = n.attrs["body"]
            lines += _graph_lines(body, indent + "    ")
            lines.append(f"{indent}    -> %{body.outputs[0]}")
            for slot, _ in enumerate(n.attrs["slots"][0] if n.attrs["slots"] else ()):
                paths = [it[slot] for it in n.attrs["slots"]]
                lines.append(f"{indent}    slot {slot}: {paths[0]} ... {paths[-1]}")
    return lines

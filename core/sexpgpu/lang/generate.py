"""The ``sample`` form: a generator making a step's (or a pass's) records by sampling
from a root after prompts taken from the data (docs/generate.md).

``:generate (sample model :new-tokens 8 :samples 4 :temperature 1.0 :top-k 0
:top-p 1.0 :stop 15 :prompt 5 :reward EXPR)``. The ``plan`` pass reads the form
(:func:`read_sample`); the ``graphs`` pass compiles the root's logits and the
reward expression over the records' fields (:func:`build_generator`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import Pos
from sexpgpu.lang import ir as g
from sexpgpu.lang.builder import Builder, Ctx, T
from sexpgpu.lang.optable import plugin_call
from sexpgpu.lang.reader import SList, Sym, show
from sexpgpu.lang.syntax import pick_keywords, split_args
from sexpgpu.lang.text import describe, err, listing, suggest

if TYPE_CHECKING:
    from sexpgpu.lang.declarations import Declarations
    from sexpgpu.lang.expr import ExprCompiler
    from sexpgpu.lang.model import Instance

__all__ = ["RECORD_FIELDS", "SamplePlan", "build_generator", "read_sample"]

SAMPLE_OPTIONS = (
    "new-tokens",
    "samples",
    "temperature",
    "top-k",
    "top-p",
    "stop",
    "prompt",
    "reward",
)

RECORD_FIELDS = (
    "prompt",
    "completion",
    "completion-mask",
    "sampled-logp",
    "sequence",
    "next",
    "next-mask",
    "reward",
)
"""The fields a generator adds to the data's own (each prompt's record ``samples`` times)."""

USAGE = "(sample model :new-tokens N :samples G :temperature T ...)"


@dataclass(frozen=True)
class SamplePlan:
    """A ``(sample ...)`` as read: its root, options and the reward expression (``None``:
    the data source's verifier)."""

    root: Sym
    new_tokens: int
    samples: int
    temperature: float
    top_k: int
    top_p: float
    stop: int | None
    prompt_length: int
    reward: Any
    verify: Any
    pos: Pos
    places: Mapping[str, Pos]
    """Where each option's value is written (errors found later point there)."""


def read_sample(node: Any, data: g.DataDecl, decls: Declarations) -> SamplePlan:
    """``node``, the value of ``:generate``, read against the prompts' ``data``."""
    if not (
        isinstance(node, SList)
        and len(node.items) >= 2
        and isinstance(node.items[0], Sym)
        and node.items[0].name == "sample"
    ):
        raise err(f":generate takes {USAGE}, got {show(node)}", node.pos)
    positional, keywords = split_args(node.items[1:])
    if len(positional) != 1 or not isinstance(positional[0], Sym):
        raise err(f"sample names the root it samples from first: {USAGE}", node.pos)
    opts = pick_keywords(keywords, SAMPLE_OPTIONS, "sample")
    st = decls.statics

    def number(key: str, default: float) -> float:
        return st.num_of(opts[key], {}, f":{key}") if key in opts else default

    def integer(key: str, default: int, low: int) -> int:
        return st.int_of(opts[key], {}, f":{key}", low) if key in opts else default

    temperature, top_p = number("temperature", 1.0), number("top-p", 1.0)
    if temperature < 0:
        raise err(
            f":temperature must be >= 0 (0 takes the likeliest token), got {temperature}",
            opts["temperature"].pos,
        )
    if not 0 < top_p <= 1:
        raise err(f":top-p must be above 0 and at most 1, got {top_p}", opts["top-p"].pos)
    hook = "sexpgpu_data_sources"
    info = decls.catalog.named(hook, "data source", data.source)
    owner = next((r.name for i, r in decls.catalog.supplied(hook) if i is info), "?")
    who = f"the data source '{data.source}' of the plugin '{owner}'"
    given = integer("prompt", 0, 1) if "prompt" in opts else None
    prompt = _prompt_length(node, opts, given, data, info, who)
    new_tokens = integer("new-tokens", 0, 1) if "new-tokens" in opts else None
    if new_tokens is None:
        raise err(f"sample needs :new-tokens (tokens to make per record): {USAGE}", node.pos)
    seq = data.fields["inputs"].shape[1]
    if prompt + new_tokens > seq:
        raise err(
            f"a prompt of {prompt} tokens and {new_tokens} new ones do not fit the "
            f"sequence of {seq} (data '{data.name}' :seq {data.seq})",
            (opts.get("new-tokens") or node).pos,
        )
    verify = info.verify
    if "reward" not in opts and verify is None:
        raise err(
            f"the data source '{data.source}' has no verifier; give sample a :reward "
            "expression over the records' fields",
            node.pos,
        )
    if verify is not None:
        verify = functools.partial(verify, data.options, data.seq)
    stop = integer("stop", 0, 0) if "stop" in opts else None
    return SamplePlan(
        positional[0],
        new_tokens,
        integer("samples", 1, 1),
        temperature,
        integer("top-k", 0, 0),
        top_p,
        stop,
        prompt,
        opts.get("reward"),
        verify,
        node.pos,
        {key: value.pos for key, value in opts.items()},
    )


def _prompt_length(
    node: Any, opts: Mapping[str, Any], given: int | None, data: g.DataDecl, info: Any, who: str
) -> int:
    """The prompt's tokens: ``:prompt`` (``given``), else the data source's own (``info``,
    supplied as ``who`` says)."""
    inputs = data.fields.get("inputs")
    if inputs is None or inputs.dtype != "i64" or len(inputs.shape) != 2:
        raise err(
            f"a generator's prompts are tokens: data '{data.name}' has no field inputs "
            f"i64[batch, seq] (it has {listing(data.fields)})",
            node.pos,
        )
    count, own = info.prompt_length, None
    if count is not None:  # a plugin's: its bug is told as its own, at the sample form
        own = plugin_call(
            who, "prompt_length", lambda: int(count(data.options, data.seq)), pos=node.pos
        )
    if given is not None:
        if own is not None and given != own and "reward" not in opts:
            raise err(
                f"the data source '{data.source}' verifies answers after its own prompt of "
                f"{own} tokens; with :prompt {given} give sample a :reward",
                opts["prompt"].pos,
            )
        return given
    if own is None:
        raise err(
            f"the data source '{data.source}' gives no prompts; say how many tokens of its "
            "inputs make one with :prompt N",
            node.pos,
        )
    return own


def record_fields(plan: SamplePlan, data: g.DataDecl) -> dict[str, g.TensorType]:
    """The records' fields: the data's, each prompt's ``samples`` times, and the
    generator's own (docs/generate.md)."""
    clash = [name for name in RECORD_FIELDS if name in data.fields]
    if clash:
        raise err(
            f"data '{data.name}' has a field '{clash[0]}', a name a generator's records use",
            plan.pos,
        )
    seq = data.fields["inputs"].shape[1]
    records = data.batch * plan.samples
    fields = {n: g.TensorType((records, *t.shape[1:]), t.dtype) for n, t in data.fields.items()}
    n, p = plan.new_tokens, plan.prompt_length
    fields.update(
        {
            "prompt": g.TensorType((records, p), "i64"),
            "completion": g.TensorType((records, n), "i64"),
            "completion-mask": g.TensorType((records, n), "f32"),
            "sampled-logp": g.TensorType((records, n), "f32"),
            "sequence": g.TensorType((records, seq), "i64"),
            "next": g.TensorType((records, seq), "i64"),
            "next-mask": g.TensorType((records, seq), "f32"),
            "reward": g.TensorType((records,), "f32"),
        }
    )
    return fields


def build_generator(
    exprs: ExprCompiler,
    plan: SamplePlan,
    data: g.DataDecl,
    roots: Mapping[str, Instance],
    name: str,
) -> g.Generator:
    """The generator ``plan`` over ``data``'s prompts: the root's logits graph and the
    reward graph, each shape-checked."""
    root = plan.root
    if root.name not in roots:
        raise err(
            f"sample: unknown root '{root.name}'{suggest(root.name, roots)}; roots: {listing(roots)}",
            root.pos,
        )
    fields = record_fields(plan, data)
    seq_type = fields["sequence"]
    b = Builder(exprs.env)
    sequence = b.input("sequence", seq_type, root.pos)
    logits = exprs.call_layer(
        roots[root.name], [sequence], root.pos, Ctx(b, None, {}, fields, roots)
    )
    if (
        not isinstance(logits, T)
        or logits.type.shape[:2] != seq_type.shape
        or len(logits.type.shape) != 3
    ):
        got = logits.type if isinstance(logits, T) else describe(logits)
        raise err(
            f"sample: the root '{root.name}' on the sequence {seq_type} must give logits "
            f"[{seq_type.shape[0]}, {seq_type.shape[1]}, vocab], got {got}",
            root.pos,
        )
    if logits.type.dtype not in ("f32", "bf16"):
        raise err(
            f"sample: the root '{root.name}' gives {logits.type}, not floating logits", root.pos
        )
    vocab = logits.type.shape[2]
    places = plan.places
    if plan.stop is not None and plan.stop >= vocab:
        raise err(f":stop {plan.stop} is not a token of the vocabulary of {vocab}", places["stop"])
    if plan.top_k > vocab:
        raise err(f":top-k {plan.top_k} is more than the vocabulary of {vocab}", places["top-k"])
    reward = None
    if plan.reward is not None:
        reward = _reward_graph(exprs, plan, fields, roots)
    return g.Generator(
        name=name,
        root=root.name,
        new_tokens=plan.new_tokens,
        samples=plan.samples,
        temperature=plan.temperature,
        top_k=plan.top_k,
        top_p=plan.top_p,
        stop=plan.stop,
        prompt_length=plan.prompt_length,
        vocab=vocab,
        fields=fields,
        logits=b.graph([logits]),
        reward=reward,
        verify=None if reward is not None else plan.verify,
        pos=plan.pos,
    )


def _reward_graph(
    exprs: ExprCompiler, plan: SamplePlan, fields: Mapping[str, g.TensorType], roots: Any
) -> g.Graph:
    b = Builder(exprs.env)
    known = {n: t for n, t in fields.items() if n != "reward"}
    ctx = Ctx(b, None, {}, known, roots)
    out = exprs.expr(plan.reward, ctx)
    want = (fields["reward"].shape[0],)
    if not isinstance(out, T) or out.type.shape != want:
        got = out.type if isinstance(out, T) else describe(out)
        raise err(
            f":reward must give one number per record, f32[{want[0]}], got {got}", plan.reward.pos
        )
    if out.type.dtype != "f32":
        out = b.add("cast", [out], {"dtype": "f32"}, plan.reward.pos)
    return b.graph([out])

"""A generator's key/value cache: its logits graph run on the new positions alone.

A trip of a generator needs the logits at one position, and a causal model's logits
there depend on the positions before it only through its attentions' keys and
values. So when the root's graph allows it (:func:`sequence_plan`), the sampler runs
two functions compiled here from that graph instead of the whole forward: *prefill*
over the prompt's positions (what follows its last attention, at the last one
alone: the logits are read there only), then *step* over the one position written
last trip.
Each causal ``attention`` writes its new keys and values into a cache of the whole
sequence (``[records, heads, seq, width / heads]``, one per attention and repeat
iteration, given as inputs and written in place) and attends over the positions up
to each query: the eager lowering hands in the caches up to the last position run,
a compiling one (:attr:`~sexpgpu_torch.strategy.Strategy.fixed_shapes`) hands them
in whole and the later positions are masked. A parameter that spans the sequence (``pos [seq dim]``) is read at the
positions run; every other op runs as in the whole forward.

The graph allows it when every op either keeps the sequence axis of its argument
position by position (elementwise ops, matmul by a parameter, ``take``, the norms,
softmax over another axis, a plugin op whose spec says ``positionwise``), or is a
causal attention; anything that mixes positions otherwise (a reshape, a reduction
over the sequence, a non-causal attention) leaves the sampler running the whole
forward each trip. Cached and whole-forward logits agree to rounding, not to the
bit: which one a generator uses follows from its program, so a run and its resume
use the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sexpgpu.lang.ir import Graph, Node, TensorType
from sexpgpu.lang.ops import builtin_ops
from sexpgpu_torch.dtypes import TORCH_DTYPES
from sexpgpu_torch.graphs import Ctx, GraphCompiler
from sexpgpu_torch.kernels import merge_heads, split_heads
from sexpgpu_torch.ops import promoted

Tensor = torch.Tensor
GraphFn = Callable[[], list[Tensor]]

TOKENS, POSITIONS, NOISE = "tokens", "positions", "noise"
"""The decoding functions' inputs besides the caches: the new positions' tokens
``[records, L]``, their indices ``[L]``, and the uniform noise ``[records, vocab]`` of
the trip's draw (absent when it takes the likeliest token)."""


class NotCached(Exception):
    """The graph mixes positions in a way a cache cannot follow; the message says where."""


# ---------------------------------------------------------------- which axis is the sequence


@dataclass
class SequencePlan:
    """Where the sequence axis of each value of a graph (and of its repeat bodies) is:
    ``axes[(id(graph), node id)]`` (``None``: the value does not depend on the
    positions), and which arguments of an op are parameters to read at the positions
    run: ``reads_at[(id(graph), node id)][i]`` is the axis of argument ``i`` to index."""

    axes: dict[tuple[int, int], int | None] = field(default_factory=dict)
    reads_at: dict[tuple[int, int], tuple[int | None, ...]] = field(default_factory=dict)


Rule = Callable[[Node, list["int | None"], list[TensorType]], "int | None"]


def _no_positions(*arg_positions: int) -> Callable[[Rule], Rule]:
    """A rule whose arguments at ``arg_positions`` must not depend on the positions."""

    def wrap(rule: Rule) -> Rule:
        def checked(node: Node, axes: list[int | None], types: list[TensorType]) -> int | None:
            if any(axes[i] is not None for i in arg_positions if i < len(axes)):
                raise NotCached(f"{node.op} takes a value that depends on the positions")
            return rule(node, axes, types)

        return checked

    return wrap


def _not_over(node: Node, axis: int | None, over: Collection[int], rank: int) -> None:
    if axis is not None and axis in {a % rank for a in over}:
        raise NotCached(f"{node.op} works across the sequence axis")


def _matmul(node: Node, axes: list[int | None], types: list[TensorType]) -> int | None:
    (a, b), rank = axes, len(types[0].shape)
    if b is not None or (a is not None and (rank < 2 or a == rank - 1)):
        raise NotCached("matmul mixes the positions")
    return None if a is None else a + len(node.type.shape) - rank


def _norm(node: Node, axes: list[int | None], types: list[TensorType]) -> int | None:
    _not_over(node, axes[0], [-1], len(types[0].shape))
    return axes[0]


def _softmax(node: Node, axes: list[int | None], types: list[TensorType]) -> int | None:
    _not_over(node, axes[0], [int(node.attrs["axis"])], len(types[0].shape))
    return axes[0]


def _reduce(node: Node, axes: list[int | None], types: list[TensorType]) -> int | None:
    a, rank = axes[0], len(types[0].shape)
    over = [int(x) % rank for x in node.attrs.get("axes", ())]
    _not_over(node, a, over, rank)
    if a is None or node.attrs.get("keepdim", False):
        return a
    return a - sum(1 for x in over if x < a)


def _slice(node: Node, axes: list[int | None], types: list[TensorType]) -> int | None:
    _not_over(node, axes[0], [int(node.attrs["axis"])], len(types[0].shape))
    return axes[0]


def _attention(node: Node, axes: list[int | None], types: list[TensorType]) -> int | None:
    if axes == [None, None, None]:
        return None
    if not node.attrs.get("causal", False) or axes != [1, 1, 1] or len(types[0].shape) != 3:
        raise NotCached("attention that is not causal over [records, seq, width] mixes positions")
    return 1


_RULES: dict[str, Rule] = {
    "matmul": _matmul,
    "take": _no_positions(0)(lambda node, axes, types: axes[1]),
    "layer_norm": _no_positions(1, 2)(_norm),
    "rms_norm": _no_positions(1)(_norm),
    "softmax": _softmax,
    "log_softmax": _softmax,
    **{name: _reduce for name in ("sum", "mean", "max")},
    "slice": _slice,
    "attention": _attention,
}
"""How each built-in op that is not position-wise moves the sequence axis of its
arguments (an op whose spec says ``positionwise`` is :func:`_elementwise`); an op
absent here cannot be cached."""


def sequence_plan(graph: Graph, plugin_ops: Sequence[Any] = ()) -> SequencePlan:
    """Where the sequence axis of ``graph``'s input ``sequence`` goes; raises
    :class:`NotCached` when the graph mixes positions otherwise than by causal
    attention, or its output is not ``[records, seq, vocab]`` along it."""
    plan = SequencePlan()
    specs = [*builtin_ops(), *(info.spec for info in plugin_ops)]
    positionwise = {spec.name for spec in specs if spec.positionwise}
    (out,) = graph.outputs
    if _walk(graph, None, plan, positionwise) != 1 or len(graph.nodes[out].type.shape) != 3:
        raise NotCached("the logits are not [records, seq, vocab] along the sequence")
    return plan


def _walk(
    graph: Graph, carry: int | None, plan: SequencePlan, positionwise: set[str]
) -> int | None:
    """Fill ``plan`` for ``graph``; the axis of its (first) output."""
    gid = id(graph)
    for node in graph.nodes:
        axes = [plan.axes[(gid, a)] for a in node.args]
        types = [graph.nodes[a].type for a in node.args]
        plan.axes[(gid, node.id)] = _axis_of(node, axes, types, carry, plan, positionwise, gid)
    return plan.axes[(gid, graph.outputs[0])]


def _axis_of(
    node: Node,
    axes: list[int | None],
    types: list[TensorType],
    carry: int | None,
    plan: SequencePlan,
    positionwise: set[str],
    gid: int,
) -> int | None:
    op = node.op
    if op == "input":
        name = node.attrs["name"]
        if name == "sequence":
            return 1
        if name == "carry":
            return carry
        raise NotCached(f"the graph reads the input '{name}'")
    if op in ("param", "const"):
        return None
    if op == "repeat":
        body: Graph = node.attrs["body"]
        if _walk(body, axes[0], plan, positionwise) != axes[0]:
            raise NotCached("a repeat moves the sequence axis")
        return axes[0]
    if op in positionwise:
        return _elementwise(node, axes, types, plan, gid)
    rule = _RULES.get(op)
    if rule is None:
        raise NotCached(f"{op} may mix the positions")
    return rule(node, axes, types)


def _elementwise(
    node: Node, axes: list[int | None], types: list[TensorType], plan: SequencePlan, gid: int
) -> int | None:
    """Broadcasting ops: every argument that depends on the positions has the sequence
    at the same axis of the result; one that does not but spans that axis (a
    parameter ``[seq dim]`` added to ``[records seq dim]``) is read at the positions."""
    rank = len(node.type.shape)
    placed = {a + rank - len(t.shape) for a, t in zip(axes, types, strict=True) if a is not None}
    if not placed:
        return None
    if len(placed) > 1:
        raise NotCached(f"{node.op} lines up different axes with the sequence")
    (axis,) = placed
    reads: list[int | None] = []
    for a, t in zip(axes, types, strict=True):
        own = axis - (rank - len(t.shape))
        reads.append(own if a is None and own >= 0 and t.shape[own] != 1 else None)
    if any(r is not None for r in reads):
        plan.reads_at[(gid, node.id)] = tuple(reads)
    return axis


# ---------------------------------------------------------------- the decoding functions


@dataclass(frozen=True)
class Decoders:
    """A graph's two decoding functions (over :data:`TOKENS`, :data:`POSITIONS`,
    :data:`NOISE` and the caches in the context's inputs; each returns the logits at
    the last position run, ``[records, vocab]``, and the token and log-probability
    drawn from them) and each cache's heads, width per head and dtype."""

    prefill: GraphFn
    step: GraphFn
    caches: tuple[tuple[int, int, torch.dtype], ...]
    fixed_shapes: bool = False
    """Read each cache whole with the positions after the queries masked (the same
    shapes at every trip), rather than up to the last position run."""

    def new_caches(self, records: int, seq: int, device: torch.device) -> dict[str, Tensor]:
        """Empty caches for ``records`` sequences of ``seq`` positions, one pair per
        attention: ``[records, heads, seq, width per head]``."""
        return {
            f"cache.{i}.{kv}": torch.zeros((records, heads, seq, width), dtype=dtype, device=device)
            for i, (heads, width, dtype) in enumerate(self.caches)
            for kv in ("k", "v")
        }


def compile_decoders(
    graph: Graph,
    ctx: Ctx,
    kernels: Mapping[str, Callable[..., Any]],
    device: torch.device,
    plugin_ops: Sequence[Any],
    choose: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]],
    strategy: Any = None,
) -> Decoders | None:
    """``graph``'s :class:`Decoders`, each function as ``strategy`` runs an eval pass
    (:class:`sexpgpu_torch.strategy.Strategy`; as it is without one), drawing each
    trip's token with ``choose(row, noise)`` (``noise`` ``None``: the likeliest), or
    ``None`` when the graph cannot be cached (the sampler then runs the whole forward
    each trip)."""
    try:
        plan = sequence_plan(graph, plugin_ops)
    except NotCached:
        return None
    made = []
    fixed = bool(strategy and strategy.fixed_shapes)
    stacks = frozenset(n.site for n in graph.nodes if n.op == "repeat")  # emitted unrolled
    for name in ("prefill", "step"):  # two functions, so a compiler keeps one shape each
        # the prefill writes from position 0 and masks within the prompt; a step masks
        # only a cache read whole
        prefill = name == "prefill"
        comp = _Decoding(plan, ctx, kernels, device, stacks, plugin_ops, prefill, prefill or fixed)
        comp.types = {n.id: n.type for n in graph.nodes}
        (logits,) = comp.emit_graph(graph)
        drawn = comp._call(_drawing(ctx, choose), [logits])
        function = comp.function(name, [], f"[*{comp.names[drawn]}]")
        made.append((strategy.evaluation(function) if strategy else function, comp.caches))
    (first, caches), (step, _) = made
    return Decoders(first, step, tuple(caches), fixed)


def _drawing(
    ctx: Ctx, choose: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]]
) -> Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]:
    """The decoding function's last line: the logits at the last position run, and the
    token and log-probability ``choose`` draws from them with the trip's noise (in the
    same graph, so a compiling strategy compiles the draw too)."""

    def drawn(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        row = logits[:, -1, :].float()
        return (row, *choose(row, ctx.inputs.get(NOISE)))

    return drawn


class _Decoding(GraphCompiler):
    """The graph compiler emitting the decoding function (see the module docstring):
    the sequence input reads :data:`TOKENS`, repeats are emitted iteration by
    iteration (each iteration's attention has its own cache), parameters spanning the
    sequence are indexed at :data:`POSITIONS`, and attentions go through the cache."""

    def __init__(
        self,
        plan: SequencePlan,
        ctx: Ctx,
        kernels: Mapping[str, Callable[..., Any]],
        device: torch.device,
        stacks: Collection[str],
        plugin_ops: Sequence[Any],
        from_start: bool,
        masks: bool,
    ) -> None:
        super().__init__(ctx, kernels, device, stacks, plugin_ops)
        self.plan = plan
        self.from_start, self.masks = from_start, masks
        self.caches: list[tuple[int, int, torch.dtype]] = []
        self.graph_id = 0
        self.read_at: dict[tuple[Any, ...], int] = {}
        self.tail = False  # emitting the prefill past its last attention

    def emit_graph(self, graph: Graph, **kw: Any) -> list[int]:
        outer, self.graph_id = self.graph_id, id(graph)
        try:
            if self.from_start and outer == 0:  # the prefill's own graph
                return self._emit_to_the_last_position(graph)
            return super().emit_graph(graph, **kw)
        finally:
            self.graph_id = outer

    def _emit_to_the_last_position(self, graph: Graph) -> list[int]:
        """The prefill's graph, every op after the last one that mixes positions (an
        attention, or a repeat of some) run at the last position alone: the logits
        are read there only, and a vocabulary's worth per prompt position would be
        thrown away (the hand-written loop's ``x[:, -1]`` before the head)."""
        gid = id(graph)
        cut = max((i for i, n in enumerate(graph.nodes) if self._mixes(n, gid)), default=-1)
        where: dict[int, int] = {}
        last: set[int] = set()  # the nodes whose values are at the last position already
        for i, node in enumerate(graph.nodes):
            self.tail = i > cut
            args = dict(where)
            for a in node.args if self.tail else ():
                axis = self.plan.axes[(gid, a)]
                if axis is not None and a not in last:
                    args[a] = self._at_last(where[a], axis)
            where[node.id] = self.emit_node(node, args, None, None, None, None)
            if self.tail and node.op != "input" and self.plan.axes[(gid, node.id)] is not None:
                last.add(node.id)  # made of values at the last position (an input is whole)
        self.tail = False
        return [where[i] for i in graph.outputs]

    def _mixes(self, node: Node, gid: int) -> bool:
        """Whether ``node`` mixes positions: an attention over them, or a repeat of a
        body with one (the sequence plan allows no other way)."""
        if node.op == "attention":
            return self.plan.axes[(gid, node.id)] is not None
        if node.op == "repeat":
            body: Graph = node.attrs["body"]
            return any(self._mixes(n, id(body)) for n in body.nodes)
        return False

    def _at_last(self, value: int, axis: int) -> int:
        """``value`` at the last position run along ``axis`` (a view of length one)."""
        key = (value, axis, "last")
        if key not in self.read_at:
            self.read_at[key] = self._line(f"{self.names[value]}.narrow({axis}, -1, 1)")
        return self.read_at[key]

    def emit_node(
        self,
        node: Node,
        where: dict[int, int],
        carry: int | None,
        slot_paths: Sequence[str] | None,
        slot_indices: dict[int, int] | None,
        iteration: int | None,
    ) -> int:
        if node.op == "input" and node.attrs["name"] == "sequence":
            return self._line(f"ctx.inputs[{TOKENS!r}]")
        if node.op == "attention" and self.plan.axes[(self.graph_id, node.id)] is not None:
            args = [where[a] for a in node.args]
            return self._call(self._cached_attention(node), args)
        reads = self.plan.reads_at.get((self.graph_id, node.id))
        if reads is None:
            return super().emit_node(node, where, carry, slot_paths, slot_indices, iteration)
        args = [
            where[a] if axis is None else self._at_positions(where[a], axis)
            for a, axis in zip(node.args, reads, strict=True)
        ]
        return self._call(self.op_function(node, iteration), args)

    def _at_positions(self, value: int, axis: int) -> int:
        """``value`` read at the positions run along ``axis`` (once per value): the
        prefill's are the first ones, a view."""
        if self.tail:  # the prefill past its last attention: the last position alone
            return self._at_last(self._at_positions_run(value, axis), axis)
        return self._at_positions_run(value, axis)

    def _at_positions_run(self, value: int, axis: int) -> int:
        key = (value, axis)
        if key not in self.read_at:
            name = self.names[value]
            self.read_at[key] = self._line(
                f"{name}.narrow({axis}, 0, ctx.inputs[{TOKENS!r}].shape[1])"
                if self.from_start
                else f"{name}.index_select({axis}, ctx.inputs[{POSITIONS!r}])"
            )
        return self.read_at[key]

    def _cached_attention(self, node: Node) -> Callable[..., Tensor]:
        index, heads = len(self.caches), int(node.attrs["heads"])
        width = int(self.types[node.args[1]].shape[-1]) // heads
        self.caches.append((heads, width, TORCH_DTYPES[node.type.dtype]))
        ctx, from_start, masks = self.ctx, self.from_start, self.masks
        keys_name, values_name = f"cache.{index}.k", f"cache.{index}.v"

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            given = ctx.inputs
            keys, values, positions = given[keys_name], given[values_name], given[POSITIONS]
            return cached_attention(
                q, k, v, keys, values, positions, heads, from_start=from_start, masks=masks
            )

        return promoted(node, self, attend)


def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    values: Tensor,
    positions: Tensor,
    heads: int,
    *,
    from_start: bool,
    masks: bool,
) -> Tensor:
    """Causal attention of the new positions' queries ``q`` ``[records, L, width]``:
    their keys and values ``k``, ``v`` go into the caches ``[records, heads, seen,
    width / heads]`` at ``positions`` (the first ``L`` when ``from_start``: then the
    queries attend over those alone), and each query attends over the cache, the
    positions after it masked when ``masks`` (a cache read up to the last position
    run needs no mask for a single query):
    ``softmax(Q K^T / sqrt(d_head)) V`` per head, as the ``math`` kernel computes it."""
    kh, vh = split_heads(k, heads).to(keys.dtype), split_heads(v, heads).to(values.dtype)
    if from_start:  # positions 0..L-1: a plain copy, and they are all a query may see
        keys[:, :, : kh.shape[2]] = kh
        values[:, :, : vh.shape[2]] = vh
    else:
        keys.index_copy_(2, positions, kh)
        values.index_copy_(2, positions, vh)
        kh, vh = keys, values
    qh, kh, vh = split_heads(q, heads), kh.to(q.dtype), vh.to(q.dtype)
    scores = torch.matmul(qh, kh.transpose(-2, -1)) * (1.0 / math.sqrt(qh.shape[-1]))
    if masks:
        seen = torch.arange(kh.shape[2], device=kh.device)
        scores = scores.masked_fill(seen[None, :] > positions[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return merge_heads(torch.matmul(weights, vh))

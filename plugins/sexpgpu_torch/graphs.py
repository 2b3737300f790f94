"""The torch plugin's graph compiler: a checked graph to a flat list of closures.

Each graph is compiled once into a flat list of closures over one list of
values (a node's value lives at a fixed index), so a step costs one Python call
per op on top of the op itself. A repeat whose stack kernel's descriptor says
``inline`` (``unrolled``) is emitted iteration by iteration into that list; other
stack kernels are called with the body as a function.

Both lowerings compile a graph here; the trainer that runs these graphs is
:mod:`sexpgpu_torch.trainer`, and its strategy (:mod:`sexpgpu_torch.strategy`) decides
whether they run as they are or through ``torch.compile``. Each op's torch function
comes from the op table, :mod:`sexpgpu_torch.ops`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from sexpgpu.lang.ir import Graph, Node
from sexpgpu_torch.dtypes import TORCH_DTYPES
from sexpgpu_torch.ops import build
from sexpgpu_torch.rng import derive_seed

Tensor = torch.Tensor


# ---------------------------------------------------------------- the compiler


class Ctx:
    """What a running graph reads besides its values: live parameters, the step,
    whether it trains (dropout), the seed and the device."""

    __slots__ = ("params", "inputs", "step", "training", "seed", "device")

    def __init__(self, seed: int, device: torch.device) -> None:
        self.params: dict[str, Tensor] = {}
        self.inputs: dict[str, Tensor] = {}
        self.step = 0
        self.training = False
        self.seed = seed
        self.device = device

    def dropout_mask(
        self, shape: Sequence[int], keep: float, key: int, iteration: int | None
    ) -> Tensor:
        """A dropout's keep-mask over ``shape``, drawn from ``(seed, "dropout", step,
        key[, iteration])``. (A lowering that traces graphs draws it outside the trace
        and hands it in, so that no trace depends on the step.)"""
        parts = (self.seed, "dropout", self.step, key) + (() if iteration is None else (iteration,))
        gen = torch.Generator(device=self.device)
        gen.manual_seed(derive_seed(*parts))
        return torch.rand(tuple(shape), generator=gen, device=self.device) < keep


class Slots(tuple):
    """One iteration's slot tensors for a stack kernel; ``iteration`` seeds its dropout."""

    iteration: int = 0

    def __new__(cls, items: Sequence[Tensor], iteration: int) -> Slots:
        obj = super().__new__(cls, items)
        obj.iteration = iteration
        return obj


Step = Callable[[list], None]


class _Compiler:
    """Compiles graphs into closures writing one shared value list."""

    def __init__(
        self,
        ctx: Ctx,
        kernels: Mapping[str, Callable[..., Any]],
        device: torch.device,
        inline: Collection[str] = frozenset(),
        plugin_ops: Sequence[Any] = (),
    ) -> None:
        self.ctx = ctx
        self.kernels = kernels
        self.inline = inline
        self.plugin_ops = plugin_ops
        self.device = device
        self.steps: list[Step] = []
        self.template: list[Any] = []
        self.types: dict[int, Any] = {}
        # Set in a repeat body compiled as a function: the index of its value list
        # that holds the iteration being run (a local of the body, so that a trace
        # under torch's checkpoint sees no write outside its scope).
        self.iteration_index: int | None = None

    def alloc(self, value: Any = None) -> int:
        self.template.append(value)
        return len(self.template) - 1

    def emit_graph(
        self,
        graph: Graph,
        *,
        carry: int | None = None,
        slot_paths: Sequence[str] | None = None,
        slot_indices: dict[int, int] | None = None,
        iteration: int | None = None,
    ) -> list[int]:
        """Emit ``graph``'s nodes; returns the value indices of its outputs.

        In a repeat body, ``carry`` is the index holding the carry, and a slot
        parameter reads either ``slot_paths[slot]`` (inlined) or the value index
        given by ``slot_indices[slot]`` (a body compiled as a function).
        """
        where: dict[int, int] = {}
        for node in graph.nodes:
            where[node.id] = self.emit_node(node, where, carry, slot_paths, slot_indices, iteration)
        return [where[i] for i in graph.outputs]

    def emit_node(
        self,
        node: Node,
        where: dict[int, int],
        carry: int | None,
        slot_paths: Sequence[str] | None,
        slot_indices: dict[int, int] | None,
        iteration: int | None,
    ) -> int:
        op, attrs = node.op, node.attrs
        ctx = self.ctx
        args = [where[a] for a in node.args]
        out = self.alloc()

        if op == "input":
            name = attrs["name"]
            if name == "carry" and carry is not None:
                return carry

            # ctx.inputs is replaced per call: read it through ctx, not a captured dict.
            def step(v: list, out=out, name=name) -> None:
                v[out] = ctx.inputs[name]

            self.steps.append(step)
            return out
        if op == "param":
            if "slot" in attrs and attrs.get("path") is None:
                slot = int(attrs["slot"])
                if slot_indices is not None:
                    return slot_indices[slot]
                assert slot_paths is not None, "a slot parameter outside a repeat body"
                path = slot_paths[slot]
            else:
                path = attrs["path"]

            def step(v: list, out=out, path=path) -> None:
                v[out] = ctx.params[path]

            self.steps.append(step)
            return out
        if op == "const":
            value = attrs["value"]
            dtype = torch.int64 if node.type.dtype == "i64" else TORCH_DTYPES[node.type.dtype]
            self.template[out] = torch.tensor(value, dtype=dtype, device=self.device)
            return out
        if op == "repeat":
            return self.emit_repeat(node, args[0], out)

        fn = self.op_function(node, iteration)
        if getattr(fn, "reads_iteration", False):
            args.append(self.iteration_index)
        self._append(fn, out, args)
        return out

    def _append(self, fn: Callable[..., Any], out: int, args: list[int]) -> None:
        # Specialise on arity so the common ops run without building argument lists.
        if len(args) == 1:
            (a,) = args

            def step(v: list) -> None:
                v[out] = fn(v[a])
        elif len(args) == 2:
            a, b = args

            def step(v: list) -> None:
                v[out] = fn(v[a], v[b])
        elif len(args) == 3:
            a, b, c = args

            def step(v: list) -> None:
                v[out] = fn(v[a], v[b], v[c])
        else:

            def step(v: list) -> None:
                v[out] = fn(*[v[i] for i in args])

        self.steps.append(step)

    def op_function(self, node: Node, iteration: int | None) -> Callable[..., Tensor]:
        """The torch function computing ``node`` from its arguments' values
        (built by the op table, :data:`sexpgpu_torch.ops.IMPLEMENTATIONS`)."""
        return build(node, self, iteration)

    def arg_type(self, node: Node, i: int) -> Any:
        """The type of ``node``'s argument ``i``."""
        return self.types[node.args[i]]

    def dropout(self, p: float, key: int, iteration: int | None) -> Callable[..., Tensor]:
        """Dropout whose mask is drawn from ``(seed, "dropout", step, key[, iteration])``.

        In a repeat body compiled as a function the iteration is known only when the
        body runs: the function returned then takes it as a second argument, read from
        the body's value list (it is marked ``reads_iteration``)."""
        ctx = self.ctx
        keep = 1.0 - p

        def run(x: Tensor, it: int | None = iteration) -> Tensor:
            if not ctx.training or p == 0.0:
                return x
            mask = ctx.dropout_mask(x.shape, keep, key, it)
            return x * mask.to(x.dtype) * (1.0 / keep)

        reads = iteration is None and self.iteration_index is not None
        run.reads_iteration = reads  # type: ignore[attr-defined]
        return run

    # -- repeats

    def emit_repeat(self, node: Node, carry_in: int, out: int) -> int:
        attrs = node.attrs
        body: Graph = attrs["body"]
        slots: Sequence[Sequence[str]] = attrs["slots"]
        count = int(attrs["count"])
        kernel = self.kernels[node.site]
        saved_types = self.types
        self.types = {n.id: n.type for n in body.nodes}
        try:
            if node.site in self.inline:  # the kernel's descriptor allows it
                current = carry_in
                for i in range(count):
                    (current,) = self.emit_graph(
                        body, carry=current, slot_paths=slots[i], iteration=i
                    )
                return current
            run_body = self.body_function(body)
        finally:
            self.types = saved_types
        ctx = self.ctx
        paths = [tuple(s) for s in slots[:count]]

        def step(v: list) -> None:
            params = ctx.params
            per_iter = [Slots([params[p] for p in ps], i) for i, ps in enumerate(paths)]
            v[out] = kernel(run_body, v[carry_in], per_iter)

        self.steps.append(step)
        return out

    def body_function(self, body: Graph) -> Callable[[Tensor, Sequence[Tensor]], Tensor]:
        """A repeat body as ``fn(carry, slot_tensors) -> Tensor`` for a stack kernel."""
        sub = _Compiler(self.ctx, self.kernels, self.device, self.inline, self.plugin_ops)
        sub.types = self.types
        sub.iteration_index = iteration = sub.alloc(0)
        carry = sub.alloc()
        n_slots = 1 + max(
            (int(n.attrs["slot"]) for n in body.nodes if n.op == "param" and "slot" in n.attrs),
            default=-1,
        )
        slot_idx = {s: sub.alloc() for s in range(n_slots)}
        (result,) = sub.emit_graph(body, carry=carry, slot_indices=slot_idx, iteration=None)
        # Dropout in a body compiled as a function takes its iteration from the
        # Slots it is called with, through the body's own value list.
        runner_steps = tuple(sub.steps)
        template = sub.template
        slot_positions = list(slot_idx.items())

        def run(carry_value: Tensor, slot_tensors: Sequence[Tensor]) -> Tensor:
            v = template.copy()
            v[carry] = carry_value
            for s, i in slot_positions:
                v[i] = slot_tensors[s]
            v[iteration] = getattr(slot_tensors, "iteration", 0)
            for st in runner_steps:
                st(v)
            return v[result]

        return run


def compile_graph(
    graph: Graph,
    ctx: Ctx,
    kernels: Mapping[str, Callable[..., Any]],
    device: torch.device,
    inline: Collection[str] = frozenset(),
    plugin_ops: Sequence[Any] = (),
) -> Callable[[], list[Tensor]]:
    """``graph`` as a function of ``ctx`` returning its outputs' values; ``kernels``
    are the sites' callables, and the repeats at the ``inline`` sites are emitted
    iteration by iteration instead of calling theirs. A plugin's op takes its
    implementation from ``plugin_ops`` (``Supplies.ops``)."""
    comp = _Compiler(ctx, kernels, device, inline, plugin_ops)
    comp.types = {n.id: n.type for n in graph.nodes}
    outputs = comp.emit_graph(graph)
    steps = tuple(comp.steps)
    template = comp.template

    def run() -> list[Tensor]:
        v = template.copy()
        for st in steps:
            st(v)
        return [v[i] for i in outputs]

    return run

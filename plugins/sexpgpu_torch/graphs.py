"""The torch plugin's graph compiler: a checked graph to one straight-line function.

Each graph is compiled once into the source of a Python function with one line per
op, each value a local variable (``v7 = f7(v3, v5)``), so a step costs one call per
op on top of the op itself, and ``torch.compile`` traces a short plain function. A
repeat whose stack kernel's descriptor says ``inline`` (``unrolled``) is emitted
iteration by iteration into those lines; other stack kernels are called with the
body, itself such a function.

Both lowerings compile a graph here; the trainer that runs these graphs is
:mod:`sexpgpu_torch.trainer`, and its strategy (:mod:`sexpgpu_torch.strategy`) decides
whether they run as they are or through ``torch.compile``. Each op's torch function
comes from the op table, :mod:`sexpgpu_torch.ops`.
"""

from __future__ import annotations

import hashlib
import linecache
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
    whether it trains (dropout), the seed and the device; ``units``, set while a
    run's parameters are fully sharded (:mod:`sexpgpu_torch.placement.fully_sharded`), runs
    each iteration of a repeat through the module that gathers its parameters."""

    __slots__ = ("params", "inputs", "step", "training", "seed", "device", "units", "align")

    fuses = False
    """Whether the graphs go through a compiler that fuses elementwise work into the
    reductions reading it (an op may then leave its memory to the compiler)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.params: dict[str, Tensor] = {}
        self.inputs: dict[str, Tensor] = {}
        self.step = 0
        self.training = False
        self.seed = seed
        self.device = device
        self.units: Any = None
        self.align = 0  # the multiple matrix products are padded to as graphs are built

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


class GraphCompiler:
    """Compiles a graph into the lines of one Python function (see the module
    docstring): value ``i`` is the local ``v<i>``, each op's function the global
    ``f<i>``, each constant the global ``k<i>``."""

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
        self.lines: list[str] = []
        self.names: list[str] = []
        self.globals: dict[str, Any] = {"ctx": ctx}
        self.types: dict[int, Any] = {}
        # Set in a repeat body compiled as a function: the value that holds the
        # iteration being run (a local of the body, so that a trace under torch's
        # checkpoint sees no write outside its scope).
        self.iteration_index: int | None = None

    def alloc(self) -> int:
        self.names.append(f"v{len(self.names)}")
        return len(self.names) - 1

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
        args = [where[a] for a in node.args]
        if op == "input":
            name = attrs["name"]
            if name == "carry" and carry is not None:
                return carry
            # ctx.inputs is replaced per call: read through ctx, never kept
            return self._line(f"ctx.inputs[{name!r}]")
        if op == "param":
            if "slot" in attrs and attrs.get("path") is None:
                slot = int(attrs["slot"])
                if slot_indices is not None:
                    return slot_indices[slot]
                assert slot_paths is not None, "a slot parameter outside a repeat body"
                path = slot_paths[slot]
            else:
                path = attrs["path"]
            return self._line(f"ctx.params[{path!r}]")
        if op == "const":
            out = self.alloc()
            dtype = torch.int64 if node.type.dtype == "i64" else TORCH_DTYPES[node.type.dtype]
            self.names[out] = f"k{out}"
            self.globals[f"k{out}"] = torch.tensor(attrs["value"], dtype=dtype, device=self.device)
            return out
        if op == "repeat":
            return self.emit_repeat(node, args[0])
        fn = self.op_function(node, iteration)
        if getattr(fn, "reads_iteration", False):
            args.append(self.iteration_index)
        return self._call(fn, args)

    def _line(self, expression: str) -> int:
        """A new value computed by ``expression``."""
        out = self.alloc()
        self.lines.append(f"{self.names[out]} = {expression}")
        return out

    def _call(self, fn: Callable[..., Any], args: Sequence[int]) -> int:
        """A new value: ``fn`` of the values ``args``."""
        name = f"f{len(self.names)}"
        self.globals[name] = fn
        return self._line(f"{name}({', '.join(self.names[a] for a in args)})")

    def op_function(self, node: Node, iteration: int | None) -> Callable[..., Tensor]:
        """The torch function computing ``node`` from its arguments' values
        (built by the op table, :data:`sexpgpu_torch.ops.IMPLEMENTATIONS`)."""
        return build(node, self, iteration)

    def arg_type(self, node: Node, i: int) -> Any:
        """The type of ``node``'s argument ``i``."""
        return self.types[node.args[i]]

    @property
    def align(self) -> int:
        """The multiple a matrix product's inner and outer dimensions are padded to."""
        return self.ctx.align

    @property
    def fuses(self) -> bool:
        """Whether a compiler fuses the graph's elementwise work (:attr:`Ctx.fuses`)."""
        return self.ctx.fuses

    def dropout(self, p: float, key: int, iteration: int | None) -> Callable[..., Tensor]:
        """Dropout whose mask is drawn from ``(seed, "dropout", step, key[, iteration])``.

        In a repeat body compiled as a function the iteration is known only when the
        body runs: the function returned then takes it as a second argument, read from
        the body's values (it is marked ``reads_iteration``)."""
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

    def function(self, name: str, params: Sequence[str], returns: str) -> Callable[..., Any]:
        """The lines emitted so far as the function ``name(*params)``."""
        body = [f"def {name}({', '.join(params)}):", *(f"    {line}" for line in self.lines)]
        body.append(f"    return {returns}")
        source = "\n".join(body) + "\n"
        # one file name per source, so tracebacks and torch.compile show the lines
        filename = f"<sexpgpu graph {hashlib.sha256(source.encode()).hexdigest()[:12]}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = dict(self.globals)
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own lines
        return namespace[name]

    # -- repeats

    def emit_repeat(self, node: Node, carry_in: int) -> int:
        attrs = node.attrs
        body: Graph = attrs["body"]
        slots: Sequence[Sequence[str]] = attrs["slots"]
        count = int(attrs["count"])
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
        kernel = self.kernels[node.site]
        ctx = self.ctx
        paths = [tuple(s) for s in slots[:count]]

        def repeat(carry: Tensor) -> Tensor:
            if ctx.units is not None:  # each iteration's parameters gathered by its unit
                through = ctx.units.body(run_body, paths)
                return kernel(through, carry, [Slots((), i) for i in range(len(paths))])
            params = ctx.params
            per_iter = [Slots([params[p] for p in ps], i) for i, ps in enumerate(paths)]
            return kernel(run_body, carry, per_iter)

        return self._call(repeat, [carry_in])

    def body_function(self, body: Graph) -> Callable[[Tensor, Sequence[Tensor]], Tensor]:
        """A repeat body as ``fn(carry, slot_tensors) -> Tensor`` for a stack kernel."""
        sub = GraphCompiler(self.ctx, self.kernels, self.device, self.inline, self.plugin_ops)
        sub.types = self.types
        # Dropout in a body compiled as a function takes its iteration from the
        # Slots it is called with, kept among the body's own values.
        sub.iteration_index = sub._line('getattr(slot_tensors, "iteration", 0)')
        carry = sub._line("carry")
        n_slots = 1 + max(
            (int(n.attrs["slot"]) for n in body.nodes if n.op == "param" and "slot" in n.attrs),
            default=-1,
        )
        slot_idx = {s: sub._line(f"slot_tensors[{s}]") for s in range(n_slots)}
        (result,) = sub.emit_graph(body, carry=carry, slot_indices=slot_idx, iteration=None)
        return sub.function("body", ["carry", "slot_tensors"], sub.names[result])


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
    comp = GraphCompiler(ctx, kernels, device, inline, plugin_ops)
    comp.types = {n.id: n.type for n in graph.nodes}
    outputs = comp.emit_graph(graph)
    return comp.function("graph", [], f"[{', '.join(comp.names[i] for i in outputs)}]")

"""Build :class:`sexpgpu.lang.ir.Program` objects by hand, for lowering tests that do not
depend on the `.sx` compiler. Node types come from the compiler's own shape rules
(:func:`sexpgpu.lang.ops.infer`), so a hand-built graph is typed as a compiled one is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.ir import (
    ChoiceSite,
    DataDecl,
    EvalPass,
    Graph,
    Init,
    Node,
    OptimizerDecl,
    ParamDecl,
    Program,
    RunSettings,
    Schedule,
    Stage,
    TensorType,
)
from sexpgpu.lang.ops import infer

POS = Pos("test.sx", 1, 1)


class G:
    """A graph under construction: each method adds a node and returns its id."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(
        self,
        op: str,
        *args: int,
        type: TensorType | None = None,
        site: str | None = None,
        **attrs: Any,
    ) -> int:
        t = type or infer(op, [self.nodes[a].type for a in args], attrs, POS)
        self.nodes.append(Node(len(self.nodes), op, tuple(args), attrs, t, POS, site))
        return len(self.nodes) - 1

    def input(self, name: str, shape: Sequence[int], dtype: str = "f32") -> int:
        return self.add("input", type=TensorType(tuple(shape), dtype), name=name)

    def param(self, path: str, shape: Sequence[int], dtype: str = "f32") -> int:
        return self.add("param", type=TensorType(tuple(shape), dtype), path=path)

    def slot(self, slot: int, shape: Sequence[int], dtype: str = "f32") -> int:
        return self.add("param", type=TensorType(tuple(shape), dtype), slot=slot)

    def const(self, value: float | int) -> int:
        dtype = "i64" if isinstance(value, int) else "f32"
        return self.add("const", type=TensorType((), dtype), value=value)

    def graph(self, *outputs: int) -> Graph:
        return Graph(tuple(self.nodes), tuple(outputs))


def param(
    path: str,
    shape: Sequence[int],
    *,
    init: Init = Init("normal", (0.5,)),
    dtype: str = "f32",
    trainable: bool = True,
    tags: tuple[str, ...] = (),
) -> ParamDecl:
    return ParamDecl(path, TensorType(tuple(shape), dtype), init, trainable, tags, None, POS)


def data(fields: Mapping[str, TensorType], name: str = "train", batch: int = 4) -> DataDecl:
    return DataDecl(name, "test", {}, 8, batch, dict(fields), POS)


def stage(
    loss: Graph,
    fields: Mapping[str, TensorType],
    *,
    optimizer: str = "sgd",
    options: Mapping[str, Any] | None = None,
    steps: int = 10,
    clip: float | None = None,
    name: str = "main",
) -> Stage:
    decl = OptimizerDecl(optimizer, dict(options or {"lr": 0.1}), Schedule(), clip, POS)
    return Stage(name, steps, data(fields), decl, loss)


def program(
    params: Sequence[ParamDecl],
    stages: Sequence[Stage],
    *,
    evals: Sequence[EvalPass] = (),
    sites: Sequence[ChoiceSite] = (),
    seed: int = 7,
    precision: str = "f32",
    deterministic: bool = True,
) -> Program:
    run = RunSettings("test", None, seed, precision, (), False, deterministic)
    return Program(
        "test.sx", (), (), None, tuple(params), run, tuple(stages), tuple(evals), tuple(sites)
    )


def site(name: str, kind: str) -> ChoiceSite:
    return ChoiceSite(name, kind, POS)

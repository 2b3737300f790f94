"""The language's IR: the compiled program, a plain, torch-free data structure that
lowerings consume (docs/ir.md).

The compiler (:mod:`sexpgpu.lang`) turns `.sx` sources into a :class:`Program`
whose every tensor has a known shape and dtype. A lowering walks its graphs;
it never needs the sources. See docs/language.md for the op set and each op's
attributes, and docs/plugins.md for how a lowering uses this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.errors import Pos

DTYPES = ("f32", "bf16", "i64", "bool")
"""Tensor dtypes a graph may carry. Parameters are ``f32`` or ``bf16``."""


@dataclass(frozen=True)
class TensorType:
    """A tensor's shape (a tuple of ints; ``()`` for a scalar) and dtype."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Init:
    """A parameter initializer: ``normal`` (std), ``uniform`` (low, high), ``zeros``,
    ``ones``, ``xavier`` (gain), ``kaiming`` (gain)."""

    kind: str
    args: tuple[float, ...] = ()


@dataclass(frozen=True)
class LoadSpec:
    """A parameter read from a safetensors file (a local path or ``s3://``), or a
    sharded ``model.safetensors.index.json``, and the tensor's name there."""

    uri: str
    tensor: str


@dataclass(frozen=True)
class ParamDecl:
    """A parameter: its dotted path (``model.ff.up``), type, initializer and flags.

    Paths are the names everywhere: checkpoints, errors, metrics. ``root`` is
    the first component (``model``, or a second root such as ``teacher``).
    """

    path: str
    type: TensorType
    init: Init
    trainable: bool
    tags: tuple[str, ...]
    load: LoadSpec | None
    pos: Pos

    @property
    def root(self) -> str:
        return self.path.split(".", 1)[0]


@dataclass(frozen=True)
class Node:
    """One operation in a graph. ``args`` are ids of earlier nodes.

    Special ops: ``input`` (attrs ``name``: a data field such as ``inputs``, or
    ``carry`` inside a repeat body), ``param`` (attrs ``path``; inside a repeat
    body ``slot`` instead), ``const`` (attrs ``value``, a float or int), and
    ``repeat`` (attrs ``count``, ``body``: a :class:`Graph`, ``slots``: one tuple
    of parameter paths per iteration, indexed by a body param's ``slot``).
    ``site`` names the choice site this node is, if any.
    """

    id: int
    op: str
    args: tuple[int, ...]
    attrs: Mapping[str, Any]
    type: TensorType
    pos: Pos
    site: str | None = None


@dataclass(frozen=True)
class Graph:
    """Nodes in topological order (a node's id is its index) and the output ids."""

    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]

    def output_types(self) -> tuple[TensorType, ...]:
        return tuple(self.nodes[i].type for i in self.outputs)


@dataclass(frozen=True)
class ChoiceSite:
    """A place where a lowering picks among kernels of ``kind``; ``name`` is
    unique in the program and is the key its choice is recorded under."""

    name: str
    kind: str
    pos: Pos
    attrs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    """A file read to make the program: ``name`` as recorded (``my-run.sx``, ``<core>``),
    its resolved path (``None`` for ``<core>``) and the sha256 of its bytes."""

    name: str
    path: str | None
    sha256: str


@dataclass(frozen=True)
class Knob:
    """A knob's value and where it came from: ``default``, ``variant`` or ``command line``."""

    name: str
    value: Any
    default: Any
    source: str
    doc: str = ""


@dataclass(frozen=True)
class DataDecl:
    """A ``defdata``: its name, data source and options, sequence length, batch
    size, and the fields each batch holds."""

    name: str
    source: str
    options: Mapping[str, Any]
    seq: int
    batch: int
    fields: Mapping[str, TensorType]
    pos: Pos


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule: ``constant``, ``warmup`` (linear over ``warmup``
    steps) or ``cosine`` (linear warmup, then cosine decay to ``min_lr`` at the
    stage's last step)."""

    kind: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0


@dataclass(frozen=True)
class OptimizerDecl:
    """The optimizer a stage uses: a name from the optimizers hook, its options
    (``lr`` among them), its schedule and global-norm clipping (``None`` = off)."""

    name: str
    options: Mapping[str, Any]
    schedule: Schedule
    clip: float | None
    pos: Pos


@dataclass(frozen=True)
class Generator:
    """A ``(sample ...)``: the records a stage's step or a pass's batch makes by sampling
    ``new_tokens`` tokens from the root ``root`` after each prompt (the first
    ``prompt_length`` tokens of the data's ``inputs``), ``samples`` times per prompt
    (docs/generate.md). ``logits`` gives the root's logits ``[records, seq, vocab]`` for
    the field ``sequence``; ``reward`` gives ``f32[records]`` from the other ``fields``,
    or is ``None`` when ``verify`` (the data source's verifier, over the records as
    arrays) scores them. ``name`` is unique in the program (``stage main``, ``eval
    probe``) and keys its draws."""

    name: str
    root: str
    new_tokens: int
    samples: int
    temperature: float
    top_k: int
    top_p: float
    stop: int | None
    prompt_length: int
    vocab: int
    fields: Mapping[str, TensorType]
    logits: Graph
    reward: Graph | None
    verify: Any
    pos: Pos

    @property
    def pad(self) -> int:
        """The token after a stop and past the completion: the stop token, else 0."""
        return self.stop if self.stop is not None else 0


@dataclass(frozen=True)
class Stage:
    """One stage of a run: its steps, data, optimizer, and the graph from the data's
    fields (a generator's records, when it has one) to the scalar loss."""

    name: str
    steps: int
    data: DataDecl
    optimizer: OptimizerDecl
    loss: Graph
    generator: Generator | None = None

    @property
    def fields(self) -> Mapping[str, TensorType]:
        """The fields its loss reads: the generator's records, or the data's batch."""
        return self.generator.fields if self.generator else self.data.fields


@dataclass(frozen=True)
class EvalPass:
    """An evaluation pass: run ``every`` steps over ``batches`` batches of ``data``;
    ``graph``'s outputs are the ``metrics`` in order (scalars)."""

    name: str
    every: int
    data: DataDecl
    batches: int
    metrics: tuple[str, ...]
    graph: Graph
    generator: Generator | None = None

    @property
    def fields(self) -> Mapping[str, TensorType]:
        """The fields its metrics read: the generator's records, or the data's batch."""
        return self.generator.fields if self.generator else self.data.fields


SHARDINGS = ("none", "optimizer", "full")
"""What a run on several devices shards: nothing (replicas), the optimizer states,
or parameters, gradients and states alike."""


@dataclass(frozen=True)
class RunSettings:
    """A ``defrun``'s settings other than its stages and passes."""

    name: str
    checkpoint_every: int | None
    seed: int
    precision: str
    counters: tuple[str, ...]
    guard_finite: bool
    deterministic: bool = True
    keep_last: int | None = None
    """``:keep-last N``: complete checkpoints kept at the location (``None``: all)."""
    shard: str | None = None
    """``:shard``: what several devices shard (one of :data:`SHARDINGS`); ``None``
    leaves it to the run's request or its default, ``none``."""


@dataclass(frozen=True)
class Program:
    """Everything a lowering and the run loop need, checked and shaped."""

    file: str
    sources: tuple[Source, ...]
    knobs: tuple[Knob, ...]
    variant: str | None
    params: tuple[ParamDecl, ...]
    run: RunSettings
    stages: tuple[Stage, ...]
    evals: tuple[EvalPass, ...]
    sites: tuple[ChoiceSite, ...]

    @property
    def steps(self) -> int:
        """Total steps over every stage."""
        return sum(stage.steps for stage in self.stages)

    def param(self, path: str) -> ParamDecl:
        return next(p for p in self.params if p.path == path)

    def stage_of(self, step: int) -> tuple[int, int]:
        """(stage index, 1-based step within it) of the 1-based global ``step``."""
        start = 0
        for index, stage in enumerate(self.stages):
            if step <= start + stage.steps:
                return index, step - start
            start += stage.steps
        raise ValueError(f"step {step} is past the program's {self.steps} steps")

"""The public API for plugin authors: the descriptors hooks return (frozen dataclasses built
without importing anything heavy), the protocols of what they build, with their optional
members' defaults, and the core modules a plugin may use. No contract names a lowering's
tensor type, so that every lowering follows the same ones. These docstrings are the short
form: docs/plugins.md ("The protocols", each hook's section) gives every contract whole."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FunctionType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from sexpgpu.choices import Choices
    from sexpgpu.lang.ir import Program, TensorType


# ---------------------------------------------------------------- the public API
PUBLIC_API: Mapping[str, tuple[str, ...] | None] = {
    "sexpgpu": ("__version__",),
    # hooks, descriptors and the contracts of what they build
    "sexpgpu.extension": None,
    "sexpgpu.errors": None,
    "sexpgpu.hookspecs": None,
    "sexpgpu.log": None,
    # a lowering: the program it lowers, the choice rule and the choices it takes
    "sexpgpu.lang.ir": None,
    "sexpgpu.kernels": None,
    "sexpgpu.choices": None,
    "sexpgpu.lang.ops": None,
    "sexpgpu.checkpoint": (
        "layout_tensors",
        "jsonable",
        # a command that follows a checkpoint location (sexpgpu evaluate --follow)
        "EXPERIMENT_FILE",
        "location_of",
        "parse_step_key",
        "read_experiment",
        "step_key",
    ),
    "sexpgpu.checkpoint.evaluated": None,
    # a storage backend
    "sexpgpu.checkpoint.storage": None,
    # a command: the catalog the CLI hands it, the one way to open work, its metrics
    # and its signals
    "sexpgpu.catalog": ("Catalog",),
    "sexpgpu.opening": None,
    "sexpgpu.batches": ("Batches", "open_batches"),
    "sexpgpu.session": None,
    # a source opener: the language's reader, and JSON read as a hostile file is
    "sexpgpu.lang.reader": ("Atom", "SList", "SVec", "read"),
    "sexpgpu.checkpoint.schema": ("MAX_DEPTH", "nesting_depth"),
    "sexpgpu.metrics": ("MetricsStream", "open_sinks"),
    "sexpgpu.signals": ("StopWatch", "process_watch"),
}
"""The core modules a plugin may import, with the names it may take (``None``: all public)."""


def module_missing(module: str, hint: str) -> str | None:
    """For ``sexpgpu_unavailable``: a reason with ``hint`` when ``module`` is not installed."""
    if sys.modules.get(module) is not None:  # None there means "blocked": missing
        return None
    with contextlib.suppress(ImportError, ValueError):
        if importlib.util.find_spec(module) is not None:
            return None
    return f"{module} is not installed: {hint}"


# ---------------------------------------------------------------- lowerings
@runtime_checkable
class Trainer(Protocol):
    """What a lowering builds for a run, serving every stage: each step is proposed into new
    tensors, checked, then committed (docs/plugins.md#lowering-trainer-and-rankgroup)."""

    choices: Mapping[str, str]  #: what the lowering chose, as a checkpoint records it
    reads_loss_late: bool = False  #: reading a proposal's ``loss`` waits for the device
    exports_together: bool = False  #: ``export`` is a collective that every rank calls
    holds_replicas: bool = True  #: False: each rank holds slices of the model, no copy
    evaluates_together: bool = False  #: a step's first evaluate/generate is a collective

    def use_group(self, group: RankGroup) -> None:
        """Train as one rank of ``group``; by default refused (one device only)."""
        raise NotImplementedError("this trainer trains on one device only")

    def warm_up(self) -> float | None:
        """Compile every graph a run calls, now; the seconds it took (default ``None``)."""
        return None

    def generate(
        self,
        generator: Any,
        batch: Mapping[str, np.ndarray],
        *,
        seed: int,
        draw: tuple,
        stopping: Any,
    ) -> dict[str, np.ndarray] | None:
        """The records of ``generator`` for ``batch``'s prompts; ``None`` when abandoned."""
        raise NotImplementedError("this trainer does not generate")

    def init_params(self) -> None:
        """Initialise every parameter from the run's seed (``(seed, "init", path)``)."""

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Replace the named parameters by value (f32 arrays, which it may keep)."""

    def propose(self, batch: Mapping[str, np.ndarray], *, stage: int, step: int, lr: float) -> Any:
        """Forward, backward and update into new tensors; a proposal with ``loss``."""

    def find_non_finite(self, proposal: Any) -> tuple[str, str, int] | None:
        """``None``, or (kind, name, count) of the proposal's first non-finite tensor."""

    def commit(self, proposal: Any) -> None:
        """Make the proposal the current parameters and optimizer states."""

    def export(self, *, reuse: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Host copies of (parameters, the stage's states), safe to write while training goes on."""

    def restore(
        self, params: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray], *, stage: int
    ) -> None:
        """Take parameters and ``stage``'s optimizer states back from a checkpoint."""

    def evaluate(self, pass_name: str, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Each metric's value of an eval pass on one batch (no dropout, no gradients)."""


E_GROUP = "E-DP-003"
"""The code of ranks no longer together (one gone, or holding different bytes)."""


@runtime_checkable
class RankGroup(Protocol):
    """The ranks of a data-parallel run, one process each; a collective raises ``RunError``
    (:data:`E_GROUP`) when a rank is gone (docs/plugins.md#lowering-trainer-and-rankgroup)."""

    rank: int  #: this process's rank, 0 to ``size - 1``
    size: int  #: how many ranks (devices) the run has in all
    nodes: int  #: how many machines they are on
    device: str  #: the device this rank trains on (``cuda:<local rank>``)

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes checkpoints, metrics and the status file."""

    def max(self, value: int) -> int:
        """The largest of every rank's ``value`` (one small collective)."""

    def same(self, data: bytes) -> bool:
        """Whether every rank passed the same ``data`` (a digest)."""

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over the ranks, one by one (one collective)."""

    def close(self) -> None:
        """Leave the group (after the last collective)."""


@dataclass(frozen=True)
class Supplies:
    """What a lowering is handed: every available kernel, optimizer (by name) and plugin op."""

    kernels: Sequence[KernelInfo] = ()
    optimizers: Mapping[str, OptimizerInfo] = field(default_factory=dict)
    ops: Sequence[OpInfo] = ()


class Lowering(Protocol):
    """Compiles a checked :class:`sexpgpu.lang.ir.Program` for one device kind."""

    def lower(
        self, program: Program, *, device: str, supplies: Supplies, choices: Choices
    ) -> Trainer:
        """A :class:`Trainer` for ``program`` on ``device``, taking what ``choices`` pins."""


@dataclass(frozen=True)
class LoweringInfo:
    """A lowering, serving device kinds, with a lazy factory (docs/plugins.md#sexpgpu_lowerings)."""

    name: str
    devices: tuple[str, ...]
    factory: Callable[[], Lowering]
    doc: str = ""
    default_for: tuple[str, ...] | None = None  #: kinds it is the default for (None: devices)
    group: Callable[[str], RankGroup | None] | None = None  #: joins the ranks a launcher started
    unrecorded: bool = False  #: a checkpoint that records no ``lowering`` choice ran on it
    #: the environment its libraries must start with to take the pinned choices
    environment: Callable[[Mapping[str, str]], Mapping[str, str]] | None = None
    #: the environment that makes its compiler keep its caches in a folder
    compile_cache: Callable[[str], Mapping[str, str]] | None = None
    #: runs the ranks of ``sexpgpu run --devices N``: (exit code, the line to say)
    launch: Callable[..., tuple[int, str | None]] | None = None


@dataclass(frozen=True)
class RunOptionInfo:
    """An option a plugin adds to ``sexpgpu run`` (docs/plugins.md#sexpgpu_run_options)."""

    flag: str
    choice: str  #: the recorded choice that ``flag VALUE`` requests
    help: str = ""
    values: tuple[str, ...] = ()  #: the words it takes
    minimum: int | None = None  #: or the least integer it takes (neither: any text)


# ---------------------------------------------------------------- kernels and ops
Tensor = Any
"""A lowering's tensor (``torch.Tensor`` for the torch lowering); the core never imports one."""


@dataclass(frozen=True)
class KernelInfo:
    """One implementation of a kind of choice site (docs/plugins.md#writing-a-kernel)."""

    kind: str  #: the site kind it implements (``attention``, ``conv2d``, ``stack``)
    name: str  #: recorded as the choice
    lowering: str  #: the lowering that can call it
    devices: tuple[str, ...]  #: the device kinds it runs on
    deterministic: bool  #: the same bits for the same inputs, backward included
    factory: Callable[[], Callable[..., Any]]  #: returns the callable
    priority: int = 0  #: higher wins
    doc: str = ""
    inline: bool = False  #: (``stack``) the lowering may emit the iterations itself


@dataclass(frozen=True)
class OpInfo:
    """An op of the language and its implementations (docs/plugins.md#sexpgpu_ops)."""

    name: str
    spec: Any  #: its :class:`sexpgpu.lang.ops.OpSpec`
    #: by lowering's name, the factory of its implementation there
    implementations: Mapping[str, Callable[[], Any]] = field(default_factory=dict)
    doc: str = ""


# ---------------------------------------------------------------- optimizers
class OptimizerUpdate(Protocol):
    """An optimizer's propose-then-commit update (docs/plugins.md#writing-an-optimizer)."""

    def init_states(
        self, params: Sequence[Tensor], options: Mapping[str, Any]
    ) -> dict[str, list[Tensor]]:
        """Fresh states for the trainable ``params``: a list per state name, one a parameter."""

    def propose(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Mapping[str, Sequence[Tensor]],
        *,
        lr: float,
        count: int,
        options: Mapping[str, Any],
        decay: Sequence[bool],
    ) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
        """New (parameters, states) from the current ones, which it leaves untouched."""

    elementwise: bool = False  #: each new element comes from the same element alone


@dataclass(frozen=True)
class OptimizerInfo:
    """A named optimizer (docs/plugins.md#sexpgpu_optimizers)."""

    name: str
    options: Mapping[str, Any]  #: each option's default
    state_names: Callable[[Mapping[str, Any]], tuple[str, ...]]  #: the states per parameter
    factory: Callable[[], Any]  #: builds its :class:`OptimizerUpdate`
    doc: str = ""
    plugin: str | None = None  #: the plugin that supplies it: set by the catalog


# ---------------------------------------------------------------- storage
@dataclass(frozen=True)
class ObjectIdentity:
    """An object's size and a version that changes whenever its bytes may have, for pinning."""

    size: int
    version: str


class Storage(Protocol):
    """A checkpoint location, as a storage backend opened it (docs/plugins.md#storage)."""

    uri: str  #: the location as the user wrote it, without a trailing ``/``
    takes_crc32c: bool = False  #: ``write_many`` takes ``crc32c=``, each key's checksum
    read_range_into: Callable[[str, int, memoryview], int] | None = None  #: spares a copy

    def remove_temporaries(self, prefix: str = "") -> None:
        """Remove what cut-off writes left under ``prefix``; by default nothing."""

    def describe(self) -> str:
        """One line for messages: the location and the credential source, no secrets."""

    def check_writable(self) -> None:
        """Prove the location can be listed and written (with a probe), before step 1."""

    def list_children(self, prefix: str = "") -> list[str]:
        """The sorted names of the objects and folders directly under ``prefix``."""

    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key`` (a folder is none)."""

    def read(self, key: str) -> bytes:
        """The whole object at ``key``."""

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (fewer, maybe none, at the end)."""

    def write(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` at ``key`` durably, all or nothing, replacing what was there."""

    def write_many(self, items: Mapping[str, bytes | memoryview]) -> None:
        """Store several objects concurrently; the first failure once all have ended."""

    def delete(self, key: str) -> None:
        """Remove the object at ``key`` (no error when it is not there)."""

    def identity(self, key: str) -> ObjectIdentity:
        """The object's size and version, which a checkpoint records for a ``:load`` file."""


Opener = Callable[[str], Storage]
"""Opens a location by its URI (:meth:`sexpgpu.catalog.Catalog.open_location`)."""


@dataclass(frozen=True)
class StorageBackendInfo:
    """A storage backend (docs/plugins.md#sexpgpu_storage_backends)."""

    schemes: tuple[str, ...]  #: the URI schemes it opens (a plain path's is ``file``)
    factory: Callable[[str], Storage]  #: opens a location by its URI
    doc: str = ""


# ---------------------------------------------------------------- source files
@dataclass
class OpenedSource:
    """A file ``sexpgpu run`` took as something else than a `.sx` file (a bundle), opened:
    the one thing that carries it through the run (docs/plugins.md#sexpgpu_source_openers)."""

    named: str  #: the file as the user named it (``s3://bucket/run.sxb``)
    file: str  #: the `.sx` file to compile
    root: str | None = None  #: a folder whose files a checkpoint names by their paths in it
    sets: Mapping[str, str] = field(default_factory=dict)  #: with the next two, its selection
    variant: str | None = None
    steps: int | None = None
    choices: Mapping[str, str] | None = None  #: recorded choices a fresh start pins
    files: Callable[[str, str], None] | None = None  #: refuses a file it may not read
    compile_cache: str | None = None  #: a folder of compile caches the lowering reads
    called: str = "the source's"  #: how a line names whose choices these are

    def lowered(self, lower: Callable[[], Any], *, fresh: bool) -> Any:
        """``lower()``, or a refusal in the opener's terms; by default as it comes."""
        return lower()


class SourceOpener(Protocol):
    """Opens a kind of file for a run (docs/plugins.md#sexpgpu_source_openers)."""

    def open(self, name: str, catalog: Any, *, fresh: bool) -> OpenedSource:
        """``name`` opened and checked before anything of it is compiled."""


@dataclass(frozen=True)
class SourceOpenerInfo:
    """A kind of file a run takes (docs/plugins.md#sexpgpu_source_openers)."""

    name: str
    suffix: str  #: the end of the file's name that tells it (``.sxb``)
    factory: Callable[[], SourceOpener]  #: builds its opener
    doc: str = ""


# ---------------------------------------------------------------- metrics
class MetricsSink(Protocol):
    """Receives the metrics stream, on the stream's own thread (docs/plugins.md#metricssink)."""

    def write(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Deliver events in order; raising means "try again later"."""

    def close(self) -> None:
        """Flush and release resources; called once after the last write."""

    @property
    def name(self) -> str:
        """How a run's summary names the sink; by default its class's name."""
        return type(self).__name__


@dataclass(frozen=True)
class MetricsSinkInfo:
    """A metrics sink (docs/plugins.md#sexpgpu_metrics_sinks)."""

    name: str  #: what ``--metrics-sink`` names
    factory: Callable[[str, str], MetricsSink]  #: takes (metrics folder, experiment slug)
    doc: str = ""
    location: Callable[[str, str], str] | None = None  #: where a person finds what it wrote


# ---------------------------------------------------------------- data
class DataLoader(Protocol):
    """An open data source: its batches, and where it is (docs/plugins.md#dataloader)."""

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next batch, one array per field declared by the source's ``fields``."""

    def position(self) -> dict[str, Any]:
        """Where the loader is, as JSON (saved in ``state.json``)."""

    def restore(self, position: Mapping[str, Any]) -> None:
        """Go back to a saved position: the batches that follow are the ones that would have."""

    def next_part(self, part: int, parts: int) -> dict[str, np.ndarray]:
        """Block ``part`` of ``parts`` of the next batch's rows; by default cut from the whole."""
        batch = self.next_batch()
        share = len(next(iter(batch.values()))) // parts
        return {name: rows[part * share : (part + 1) * share] for name, rows in batch.items()}


@dataclass(frozen=True)
class DataSourceInfo:
    """A data source for ``defdata`` (docs/plugins.md#sexpgpu_data_sources)."""

    name: str
    options: Mapping[str, Any]  #: each option's default
    fields: Callable[[Mapping[str, Any], int, int], Mapping[str, TensorType]]  #: without data
    factory: Callable[[Mapping[str, Any], int, int, int], DataLoader]  #: opens its loader
    check: Callable[[Mapping[str, Any], int, int], None] | None = None  #: refuses its files
    tokens_field: str | None = "inputs"  #: the field whose elements count as ``tokens``
    doc: str = ""
    option_docs: Mapping[str, str] = field(default_factory=dict)  #: a line per option
    path_options: tuple[str, ...] = ()  #: the options that name files
    prompt_length: Callable[[Mapping[str, Any], int], int] | None = None  #: a prompt's tokens
    #: a generator's records' rewards
    verify: Callable[[Mapping[str, Any], int, Mapping[str, np.ndarray]], np.ndarray] | None = None


# ---------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class EvalMetricInfo:
    """A named eval metric for ``:metrics`` (docs/plugins.md#sexpgpu_eval_metrics)."""

    name: str
    expression: str  #: `.sx` text of one scalar per batch
    finish: Callable[[float], float] | None = None  #: the number from the mean (None: itself)
    doc: str = ""


class Evaluator(Protocol):
    """Runs eval passes for a run and ``sexpgpu evaluate`` alike (docs/plugins.md#evaluator)."""

    def run_pass(
        self,
        eval_pass: Any,
        trainer: Trainer,
        *,
        seed: int,
        open_batches: Callable[[Any, int], Any],
        stopping: Callable[[], bool],
        group: RankGroup | None = None,
    ) -> dict[str, float] | None:
        """Each metric's number over the pass's batches; ``None`` if stopped before one."""


@dataclass(frozen=True)
class EvaluatorInfo:
    """The eval-pass runner, one plugin's (docs/plugins.md#sexpgpu_evaluators)."""

    name: str
    factory: Callable[[Mapping[str, EvalMetricInfo]], Evaluator]  #: given every metric by name
    doc: str = ""


# ---------------------------------------------------------------- optional members
OPTIONAL: Mapping[type, tuple[str, ...]] = {
    Trainer: (
        *("reads_loss_late", "exports_together", "holds_replicas", "evaluates_together"),
        *("use_group", "warm_up", "generate"),
    ),
    Storage: ("takes_crc32c", "read_range_into", "remove_temporaries"),
    DataLoader: ("next_part",),
    OptimizerUpdate: ("elementwise",),
    MetricsSink: ("name",),
}
"""Each protocol's optional members, whose defaults its class holds: a class that
subclasses it inherits them, and :func:`with_defaults` gives them to any other object."""

P = TypeVar("P")


def with_defaults(obj: Any, protocol: type[P]) -> P:
    """``obj``, a plugin's ``protocol``, with every optional member: itself when it
    subclasses the protocol, else a view adding the defaults of those it lacks."""
    subclassed = protocol in type(obj).__mro__
    return obj if subclassed else _WithDefaults(obj, protocol)  # type: ignore[return-value]


class _WithDefaults:
    """An object's own members, and the defaults it lacks, bound to it as if inherited."""

    def __init__(self, inner: Any, protocol: type) -> None:
        self._inner = inner
        for name in OPTIONAL[protocol]:
            if not hasattr(inner, name):  # the one look-up by name, at the boundary
                default = vars(protocol)[name]
                bound = isinstance(default, (FunctionType, property))
                self.__dict__[name] = default.__get__(inner) if bound else default

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

"""The public API for plugin authors: the descriptors hooks return, the protocols
the things they build must follow, and the list of core modules a plugin may use.

A descriptor is a small frozen dataclass that can be built without importing
anything heavy; its ``factory`` does the real work when the thing is used. The
call contracts (a kernel per kind, an optimizer's update) are written here without
any lowering's tensor type, so that every lowering follows the same ones.

A protocol's optional members (:data:`OPTIONAL`) have their defaults on it: a class
that subclasses it inherits them, and any other object gets them where the core takes
it from its plugin (:func:`with_defaults`), so that no caller asks what an object has.
"""

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
"""The core modules a plugin may import, each with the names it may take from it
(``None``: every name not starting with ``_``). Anything else in the core may change
without notice; ``tests/foundation/test_public_api.py`` holds every plugin to this."""


def module_missing(module: str, hint: str) -> str | None:
    """For ``sexpgpu_unavailable``: a reason with ``hint`` when ``module`` cannot be imported.

    Looks the module up without importing it, so checking stays cheap.
    """
    if sys.modules.get(module) is not None:  # None there means "blocked": missing
        return None
    with contextlib.suppress(ImportError, ValueError):
        if importlib.util.find_spec(module) is not None:
            return None
    return f"{module} is not installed: {hint}"


# ---------------------------------------------------------------- lowerings


@runtime_checkable
class Trainer(Protocol):
    """What a lowering builds for a run: the step and eval functions over live tensors.

    One trainer serves every stage of a program. A step is split so that
    nothing changes until it is committed: ``propose`` runs forward, backward
    and the optimizer into new tensors; ``find_non_finite`` looks at a proposal
    (one fused check, one host sync); ``commit`` makes it the current state.
    Optimizer states belong to a stage: entering a stage whose optimizer
    differs starts its states afresh.

    Four abilities are optional, with defaults here (:data:`OPTIONAL`): :meth:`use_group`
    (training as one rank of several, with :attr:`exports_together`), :meth:`warm_up`
    (compiling before the first step), :attr:`reads_loss_late` (a loss that waits for the
    device) and :meth:`generate`.
    """

    choices: Mapping[str, str]
    """What the lowering chose, as a checkpoint records it: each choice site's kernel
    and whatever else it decided (its own names), as made or as pinned."""

    reads_loss_late: bool = False
    """True when reading a proposal's ``loss`` waits for the device: the run then
    reads each step's loss once the next step is queued, or before anything else is
    said of that step, so a step's metrics cost no host sync and the events keep
    their order."""

    exports_together: bool = False
    """True when ``export`` is a collective (it gathers sharded tensors): every rank
    then calls it at each of the writer's checkpoints, and only the writer keeps it."""

    holds_replicas: bool = True
    """False when each rank holds its own slices of the model, no copy of it: there
    are no replicas to compare at the end, and ``export`` keeps nothing off the writer."""

    evaluates_together: bool = False
    """True when the first ``evaluate`` or ``generate`` after a step is a collective
    (gathering sharded parameters): every rank then calls one at least once a pass."""

    def use_group(self, group: RankGroup) -> None:
        """Train as one rank of ``group``: called once, before ``warm_up`` and before
        any parameter is set, when a run has more than one rank. ``propose`` then takes the rank's part of
        the global batch and averages the gradients across the ranks (the loss it
        reports is the mean over the ranks). The default raises ``NotImplementedError``:
        a trainer for one device only, which a run on several refuses before any step."""
        raise NotImplementedError("this trainer trains on one device only")

    def warm_up(self) -> float | None:
        """Compile every graph a run calls (losses with their backward, updates, eval
        passes) now, on stand-ins, and return the seconds it took (``run started``
        logs them). ``sexpgpu run`` calls it once, right after lowering and before any
        parameter is set; ``sexpgpu evaluate`` never does. The default compiles
        nothing and returns ``None``."""
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
        """The records of ``generator`` (:class:`sexpgpu.lang.ir.Generator`) for ``batch``'s
        prompts, trip by trip, drawn from ``(seed, "generate", generator.name, *draw,
        trip)``; ``None`` (abandoned) when ``stopping()`` holds before a trip."""
        raise NotImplementedError("this trainer does not generate")

    def init_params(self) -> None:
        """Initialise every parameter from the run's seed (``(seed, "init", path)``)."""

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Replace the named parameters by value (f32 arrays, cast to each parameter's
        dtype): the core reads ``:load`` parameters from their files and gives them
        here, after ``init_params`` on a fresh start and after ``restore`` (for the
        frozen ones, which a checkpoint does not hold) on a resume. The arrays are
        handed over: a trainer may keep a writable one instead of copying it."""

    def propose(self, batch: Mapping[str, np.ndarray], *, stage: int, step: int, lr: float) -> Any:
        """Forward, backward and optimizer update for one batch of ``stage``, into new tensors.

        ``step`` is the 1-based global number of the step being taken (it seeds
        dropout). Returns an opaque proposal with ``proposal.loss`` (a float).
        """

    def find_non_finite(self, proposal: Any) -> tuple[str, str, int] | None:
        """``None`` when every proposed tensor is finite, else (kind, name, count):
        kind is ``parameter`` or ``state``; name is ``path`` or ``path/state``; the
        first offender in parameter order, parameters before their states."""

    def commit(self, proposal: Any) -> None:
        """Make the proposal the current parameters and optimizer states."""

    def export(self, *, reuse: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Host copies of (parameters by path, current stage's states by ``path/state``),
        ``bf16`` as ``f32``, leaving out frozen ``:load`` parameters; safe to write while training goes on. With ``reuse`` the
        trainer may overwrite and hand back the previous export's arrays (the caller
        is done with them), which saves allocating a model's worth per checkpoint."""

    def restore(
        self, params: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray], *, stage: int
    ) -> None:
        """Take parameters and ``stage``'s optimizer states back from a checkpoint;
        ``params`` lacks the frozen ``:load`` ones (given by ``set_params``)."""

    def evaluate(self, pass_name: str, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Run an eval pass's graph on one batch (no dropout, no gradients); each metric's value."""


E_GROUP = "E-DP-003"
"""The code of ranks no longer together (one gone, or holding different bytes)."""


@runtime_checkable
class RankGroup(Protocol):
    """The ranks of a data-parallel run, one process each, as a lowering joins them.

    The trainer shares the work of each step (``Trainer.use_group``); the run loop
    uses the group for what the ranks must agree on: whether to stop after a step,
    the finite guard's verdict, and that the ranks still hold the same bytes. Only the writer (rank 0) writes
    checkpoints, metrics and the status file. Every collective raises
    :class:`sexpgpu.errors.RunError` (:data:`E_GROUP`) when a rank is gone.
    """

    rank: int
    """This process's rank, 0 to ``size - 1``."""
    size: int
    """How many ranks (devices) the run has in all."""
    nodes: int
    """How many machines they are on."""
    device: str
    """The device this rank trains on (``cuda`` becomes ``cuda:<local rank>``)."""

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
    """What the catalog supplies a lowering with: every available kernel, every
    available optimizer by name, and the new ops plugins supply (each with its
    implementations by lowering; see :func:`sexpgpu.lang.ops.implementation_of`)."""

    kernels: Sequence[KernelInfo] = ()
    optimizers: Mapping[str, OptimizerInfo] = field(default_factory=dict)
    ops: Sequence[OpInfo] = ()


class Lowering(Protocol):
    """Compiles a checked :class:`sexpgpu.lang.ir.Program` for one device kind."""

    def lower(
        self, program: Program, *, device: str, supplies: Supplies, choices: Choices
    ) -> Trainer:
        """Build a :class:`Trainer` for ``program`` on ``device`` (``cpu``, ``cuda``, ``cuda:1``).

        The lowering picks a kernel per choice site among ``supplies.kernels`` with
        :func:`sexpgpu.kernels.choose_kernels` (the one rule for every lowering),
        which takes the kernels ``choices`` pins (a resume's record, the user's
        ``--choose``) and raises :class:`sexpgpu.errors.CheckpointError`
        ``E-CHOICE-001`` for a recorded one it cannot take here. It takes every
        other choice it records the same way: ``choices.pin(name)`` is the value a
        resume recorded or the user asked for (``None``: its own rule), and a pinned
        value it cannot take is ``E-CHOICE-001``
        (:func:`sexpgpu.choices.cannot_take`).
        """


@dataclass(frozen=True)
class LoweringInfo:
    """A lowering: its name, the device kinds it serves, and a lazy factory.

    ``sexpgpu run --lowering NAME`` picks one by name; without it a run takes the
    lowering that is the default for its device kind (``default_for``). The name
    is recorded as the choice ``lowering`` and pinned on resume."""

    name: str
    devices: tuple[str, ...]
    factory: Callable[[], Lowering]
    doc: str = ""
    default_for: tuple[str, ...] | None = None
    """The device kinds where a run takes this lowering unless ``--lowering`` names
    another; ``None``: every kind in ``devices``. Two available lowerings that are
    the default for one kind are a conflict; serving one (by name) is not."""
    group: Callable[[str], RankGroup | None] | None = None
    """Joins the group of ranks a launcher started (``sexpgpu run --devices N``,
    ``torchrun``) for a device (``cpu``, ``cuda``): the :class:`RankGroup`, or
    ``None`` when the process was not launched as one of several ranks. A lowering
    without it trains on one device only."""
    unrecorded: bool = False
    """Whether a checkpoint that records no ``lowering`` choice (one written before the
    choice was recorded) ran on this lowering: a resume pins it then."""
    environment: Callable[[Mapping[str, str]], Mapping[str, str]] | None = None
    """The environment variables the lowering's libraries must start with to take
    these pinned choices (``OMP_NUM_THREADS`` for a thread count): ``sexpgpu run``
    sets them before anything imports those libraries, since some read their
    settings only once, when they start. Must not import them."""
    compile_cache: Callable[[str], Mapping[str, str]] | None = None
    """The environment variables that make the lowering's compiler keep its caches
    (compiled kernels and the decisions behind them) in a folder. ``sexpgpu bundle``
    compiles into an empty one and ships it; a run from the bundle compiles from its
    copy, loading the same kernels instead of choosing again. ``None``: the lowering
    compiles nothing. Must not import the compiler."""
    launch: Callable[..., tuple[int, str | None]] | None = None
    """``launch(command, *, workers, max_restarts, device, logs)`` runs ``workers``
    processes of ``command`` as the ranks ``group`` joins (``sexpgpu run --devices N``),
    waits, and returns the exit code and the line to say (docs/plugins.md)."""


@dataclass(frozen=True)
class RunOptionInfo:
    """An option a plugin adds to ``sexpgpu run``: ``flag VALUE`` requests the recorded
    choice ``choice`` (``--threads 2``: ``cpu.threads=2``; E-CHOICE-001 names the flag).
    It takes one of ``values``, an integer no less than ``minimum``, or any text."""

    flag: str
    choice: str
    help: str = ""
    values: tuple[str, ...] = ()
    minimum: int | None = None


# ---------------------------------------------------------------- kernels


Tensor = Any
"""A lowering's tensor (``torch.Tensor`` for the torch lowering); the core never imports one."""


@dataclass(frozen=True)
class KernelInfo:
    """One implementation of a kind of choice site.

    ``kind`` is the site kind (``attention``, ``stack``, ``conv2d``...) and fixes what
    ``factory()`` returns (:data:`sexpgpu.lang.ops.KERNEL_CALLS`); ``name`` is recorded as the choice
    (``math``, ``sdpa``, ``unrolled``). ``lowering`` names the lowering that can call
    it and ``devices`` the device kinds where it runs. ``deterministic`` promises the
    same bits for the same inputs on the same machine, backward included. The choice
    among the kernels that fit is :func:`sexpgpu.kernels.choose_kernels`: deterministic
    ones only unless the run asks otherwise, the highest ``priority``, then the name.
    ``inline`` (stack kernels) lets the lowering emit the iterations into the program
    instead of calling the kernel; the result must be the same as calling it.
    """

    kind: str
    name: str
    lowering: str
    devices: tuple[str, ...]
    deterministic: bool
    factory: Callable[[], Callable[..., Any]]
    priority: int = 0
    doc: str = ""
    inline: bool = False


# ---------------------------------------------------------------- ops


@dataclass(frozen=True)
class OpInfo:
    """An op of the language, as a plugin supplies it.

    ``name`` is the op's name (``squareplus``: the IR op on its nodes, and its
    name in `.sx` files unless the spec gives others); ``spec`` is its
    :class:`sexpgpu.lang.ops.OpSpec` (arguments, keywords, inference);
    ``implementations`` maps a lowering's name (``torch``) to a factory
    returning that lowering's implementation of the op (for ``torch``:
    ``build(attrs) -> fn(*tensors)``; docs/plugins.md, "Adding an op"). An
    ``OpInfo`` whose spec is a built-in op's (``sexpgpu.lang.ops.BUILTINS``)
    supplies implementations of that op, as the torch plugin does.
    """

    name: str
    spec: Any
    implementations: Mapping[str, Callable[[], Any]] = field(default_factory=dict)
    doc: str = ""


# ---------------------------------------------------------------- optimizers


class OptimizerUpdate(Protocol):
    """What an optimizer's factory returns: a propose-then-commit update.

    The lowering keeps parameters and states; the update only computes new ones, so
    a step the run refuses (non-finite values) changes nothing. Gradients arrive
    already clipped to the stage's global norm (``:clip``) when it asks for it. The
    update count is not a state: the lowering derives it from the step number and
    the first step of the stages sharing these states, which survives a resume.
    """

    def init_states(
        self, params: Sequence[Tensor], options: Mapping[str, Any]
    ) -> dict[str, list[Tensor]]:
        """Fresh states for the trainable ``params``: one list per name that
        ``OptimizerInfo.state_names(options)`` gives, aligned with ``params`` (zeros,
        f32, on the parameters' device). Checkpointed as ``path/state``."""

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
        """New (parameters, states) computed from the current ones, which must be left
        untouched. ``lr`` is the scheduled rate of this step; ``count`` the 1-based
        number of this update since the states started (bias correction); ``options``
        the optimizer's defaults overridden by the `.sx` file's; ``decay[i]`` whether
        parameter ``i`` takes weight decay. New parameters keep their inputs' dtypes."""

    elementwise: bool = False
    """Whether each new element comes from the same element alone (``:shard full`` needs it)."""


@dataclass(frozen=True)
class OptimizerInfo:
    """A named optimizer.

    ``options`` maps each option a `.sx` file may give to its default;
    ``state_names`` gives, for the options in use, the states kept per
    parameter (``("m", "v")`` for adam). ``factory`` returns the
    :class:`OptimizerUpdate` the lowering calls.
    """

    name: str
    options: Mapping[str, Any]
    state_names: Callable[[Mapping[str, Any]], tuple[str, ...]]
    factory: Callable[[], Any]
    doc: str = ""
    plugin: str | None = None
    """The plugin that supplies it: set by the catalog, for messages."""


# ---------------------------------------------------------------- storage


@dataclass(frozen=True)
class ObjectIdentity:
    """What an object is, for pinning: its size in bytes and a version that changes
    whenever its bytes may have (S3's ETag, GCS's ``generation:<n>``, ``sha256:<hex>``)."""

    size: int
    version: str


class Storage(Protocol):
    """A checkpoint location opened by a storage backend.

    Keys are ``/``-separated, relative to the location and without a leading ``/``
    (``step-00000004/params.safetensors``); a folder is a prefix of keys, never written
    itself. Every method raises :class:`sexpgpu.errors.StorageError` with one clear line
    and a code of :mod:`sexpgpu.checkpoint.storage` on failure: a missing object read is
    ``E-STORAGE-003``. Three members are optional, with defaults here (:data:`OPTIONAL`):
    :attr:`takes_crc32c`, :attr:`read_range_into` and :meth:`remove_temporaries`.
    """

    uri: str
    """The location as the user wrote it, normalised (no trailing slash)."""

    takes_crc32c: bool = False
    """Whether ``write_many`` takes ``crc32c=``, each key's CRC32C (base64 of 4 big-endian
    bytes) for the service to verify the upload, computed first (else while it runs)."""

    read_range_into: Callable[[str, int, memoryview], int] | None = None
    """``(key, start, buffer) -> bytes read``: ``read_range`` into a buffer, sparing a copy
    of each tensor ``:load`` reads; ``None``: only ``read_range``."""

    def remove_temporaries(self, prefix: str = "") -> None:
        """Remove what cut-off writes left under ``prefix``, once none runs there; by
        default nothing (an object store's uploads appear only when complete)."""

    def describe(self) -> str:
        """A one-line description for messages: the location and the credential source, no secrets."""

    def check_writable(self) -> None:
        """Prove the location can be listed and written (before a run's first step):
        list it, write and delete a probe named ``PROBE_PREFIX...`` (never listed)."""

    def list_children(self, prefix: str = "") -> list[str]:
        """The sorted names (not keys: no ``prefix``, no trailing ``/``) of the objects and
        folders directly under ``prefix``, a folder's key without a trailing ``/`` (``""``:
        the location; one is tolerated); ``[]`` when nothing is there."""

    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key`` (a folder is none)."""

    def read(self, key: str) -> bytes:
        """The whole object at ``key``."""

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (fewer, maybe none, at the end).

        ``:load`` reads a safetensors header and each tensor with one call each."""

    def write(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` at ``key`` durably, all or nothing, replacing what was there."""

    def write_many(self, items: Mapping[str, bytes | memoryview]) -> None:
        """Store several objects concurrently; returns once every one is stored, else
        raises the first failure once all have ended (with checksums: :attr:`takes_crc32c`)."""

    def delete(self, key: str) -> None:
        """Remove the object at ``key`` (no error when it is not there)."""

    def identity(self, key: str) -> ObjectIdentity:
        """``ObjectIdentity(size, version)`` of the object: a checkpoint records it for
        each ``:load`` file, and a resume compares (``E-LOAD-001``)."""


Opener = Callable[[str], Storage]
"""Opens a location by its URI with the backend that serves its scheme
(:meth:`sexpgpu.catalog.Catalog.open_location`)."""


@dataclass(frozen=True)
class StorageBackendInfo:
    """A storage backend: the URI schemes it opens and a factory taking the URI.
    A plain path has the scheme ``file``."""

    schemes: tuple[str, ...]
    factory: Callable[[str], Storage]
    doc: str = ""


# ---------------------------------------------------------------- source files


@dataclass
class OpenedSource:
    """A file ``sexpgpu run`` took as something else than a `.sx` file (a bundle), opened:
    the `.sx` ``file`` to compile, the selection and choices it carries, and what a run
    of it may read. The core holds the opened source as one thing, from the command line
    to the checkpoint; an opener subclasses it for :meth:`lowered`."""

    named: str
    """The file as the user named it (``run.sxb``, ``s3://bucket/run.sxb``)."""
    file: str
    root: str | None = None
    """A folder whose files a checkpoint names by their paths in it, the same wherever it
    is opened (``sources/run.sx``); ``None``: by their own paths."""
    sets: Mapping[str, str] = field(default_factory=dict)
    variant: str | None = None
    steps: int | None = None
    choices: Mapping[str, str] | None = None
    """Recorded choices a fresh start pins as a checkpoint's are (``None``: none)."""
    files: Callable[[str, str], None] | None = None
    """Refuses a file the program names that it may not read (``FileCheck``)."""
    compile_cache: str | None = None
    """A folder of compile caches its recorded lowering reads (``LoweringInfo.compile_cache``)."""
    called: str = "the source's"
    """How a line names whose choices these are (``the bundle's``)."""

    def lowered(self, lower: Callable[[], Any], *, fresh: bool) -> Any:
        """``lower()`` (a :class:`sexpgpu.session.Lowered`), refused in the opener's terms
        where it took or refused :attr:`choices` otherwise (a bundle made on another kind
        of machine); ``fresh``: the run chooses afresh. By default as it comes."""
        return lower()


class SourceOpener(Protocol):
    def open(self, name: str, catalog: Any, *, fresh: bool) -> OpenedSource:
        """Open ``name`` (local or in a store, through ``catalog.open_location``), checked
        before anything of it is compiled; a refusal is one :class:`SexpError`. What it
        unpacks lives as long as the process."""


@dataclass(frozen=True)
class SourceOpenerInfo:
    """A kind of file ``sexpgpu run`` and ``sexpgpu.train.run`` take, told by the end of
    its name (``.sxb``), and the factory of its :class:`SourceOpener`."""

    name: str
    suffix: str
    factory: Callable[[], SourceOpener]
    doc: str = ""


# ---------------------------------------------------------------- metrics


class MetricsSink(Protocol):
    """Receives the metrics stream. Called from the stream's own thread, never the step loop."""

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
    """A metrics sink: a name for ``--metrics-sink`` and a factory taking
    (metrics folder, experiment slug)."""

    name: str
    factory: Callable[[str, str], MetricsSink]
    doc: str = ""
    location: Callable[[str, str], str] | None = None
    """Where the sink writes an experiment, from (metrics folder, slug), as a person
    finds it (a file, a folder, a URL): a run's closing summary names it."""


# ---------------------------------------------------------------- data


class DataLoader(Protocol):
    """An open data source: yields batches and can say and restore where it is."""

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next batch, one array per field declared by the source's ``fields``."""

    def position(self) -> dict[str, Any]:
        """Where the loader is, as JSON (saved in ``state.json``)."""

    def restore(self, position: Mapping[str, Any]) -> None:
        """Go back to a saved position, so that the batches that follow are the ones
        that would have come."""

    def next_part(self, part: int, parts: int) -> dict[str, np.ndarray]:
        """Block ``part`` of ``parts`` equal blocks of the next batch's rows (a rank's share),
        moving as ``next_batch`` does; by default cut from the whole batch."""
        batch = self.next_batch()
        share = len(next(iter(batch.values()))) // parts
        return {name: rows[part * share : (part + 1) * share] for name, rows in batch.items()}


@dataclass(frozen=True)
class DataSourceInfo:
    """A data source for ``defdata``.

    ``options`` maps each option to its default. ``fields(options, seq, batch)``
    returns the batch's fields and their types without loading any data (it may
    read a file's header). ``factory(options, seq, batch, seed)`` opens a
    :class:`DataLoader`. ``counts`` says which field's elements count as
    ``tokens`` (``records`` is always the batch size). ``path_options`` are the
    options that name files: the compiler makes a relative one relative to the
    `.sx` file that writes it, as ``include`` and ``:load`` are, before
    ``fields`` and ``factory`` see it. ``check(options, seq, batch)``, if given,
    raises if the source's files are missing or too short: the compiler calls it for
    ``run`` and ``check``, but not for ``sexpgpu evaluate``, which opens only the data
    its passes read (an evaluator on another machine has no training data). A source
    whose ``fields`` need a file (``npy`` reads its headers) needs it everywhere.
    ``prompt_length(options, seq)``: the tokens of ``inputs`` that prompt a generator;
    ``verify(options, seq, records)``: its records' rewards (docs/generate.md).
    """

    name: str
    options: Mapping[str, Any]
    fields: Callable[[Mapping[str, Any], int, int], Mapping[str, TensorType]]
    factory: Callable[[Mapping[str, Any], int, int, int], DataLoader]
    check: Callable[[Mapping[str, Any], int, int], None] | None = None
    tokens_field: str | None = "inputs"
    doc: str = ""
    option_docs: Mapping[str, str] = field(default_factory=dict)
    path_options: tuple[str, ...] = ()
    prompt_length: Callable[[Mapping[str, Any], int], int] | None = None
    verify: Callable[[Mapping[str, Any], int, Mapping[str, np.ndarray]], np.ndarray] | None = None


# ---------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class EvalMetricInfo:
    """A named eval metric that ``(eval ... :metrics (NAME ...))`` may list.

    ``expression`` is `.sx` text computing one scalar per batch, over the names
    ``logits`` (the model applied to the batch's ``inputs``), ``targets`` (the
    batch's field) and ``loss`` (the run's ``:loss`` on the batch); it may call
    any op, a plugin's included. The pass averages the per-batch values over its
    batches, then ``finish`` (``None``: the mean itself) turns the mean into the
    reported number on the host (``perplexity`` is ``exp`` of the mean ``loss``).
    """

    name: str
    expression: str
    finish: Callable[[float], float] | None = None
    doc: str = ""


class Evaluator(Protocol):
    """Runs eval passes on a live trainer: what a run and ``sexpgpu evaluate`` both call,
    so a pass gives the same numbers in either."""

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
        """Run ``eval_pass`` (a :class:`sexpgpu.lang.ir.EvalPass`) over its batches.

        ``open_batches(eval_pass, seed)`` opens its :class:`sexpgpu.batches.Batches`
        (``.loader``, and ``.made(batch, draw)``: the records the pass's generator makes,
        when it has one); ``seed`` is the run's; the ``group`` of several ranks shares
        the batches.
        Returns each metric's number, or ``None`` when ``stopping()`` became true
        before a batch (a signal): the pass then reports nothing.
        """


@dataclass(frozen=True)
class EvaluatorInfo:
    """The eval-pass runner: ``factory(metrics)`` builds an :class:`Evaluator` given
    every available :class:`EvalMetricInfo` by name. One plugin supplies it."""

    name: str
    factory: Callable[[Mapping[str, EvalMetricInfo]], Evaluator]
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
"""Each protocol's optional members, whose defaults its class holds."""

P = TypeVar("P")


def with_defaults(obj: Any, protocol: type[P]) -> P:
    """``obj``, a plugin's ``protocol``, with every optional member: itself when it
    subclasses the protocol, else a view adding the defaults of those it lacks."""
    return obj if protocol in type(obj).__mro__ else _WithDefaults(obj, protocol)  # type: ignore[return-value]


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

"""The public API for plugin authors: the descriptors hooks return, and the protocols
the things they build must follow.

A descriptor is a small frozen dataclass that can be built without importing
anything heavy; its ``factory`` does the real work when the thing is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from sexpgpu.graph import Program, TensorType


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
    """

    choices: Mapping[str, str]
    """Choice site -> implementation name, as made or as pinned."""

    def init_params(self) -> None:
        """Initialise every parameter from the run's seed (``(seed, "init", path)``)."""

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
        ``bf16`` as ``f32``; safe to write while training goes on. With ``reuse`` the
        trainer may overwrite and hand back the previous export's arrays (the caller
        is done with them), which saves allocating a model's worth per checkpoint."""

    def restore(
        self, params: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray], *, stage: int
    ) -> None:
        """Take parameters and ``stage``'s optimizer states back from a checkpoint."""

    def evaluate(self, pass_name: str, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Run an eval pass's graph on one batch (no dropout, no gradients); each metric's value."""


class Lowering(Protocol):
    """Compiles a checked :class:`sexpgpu.graph.Program` for one device kind."""

    def lower(
        self,
        program: Program,
        *,
        device: str,
        kernels: Sequence[KernelInfo],
        optimizers: Mapping[str, OptimizerInfo],
        pinned: Mapping[str, str] | None,
    ) -> Trainer:
        """Build a :class:`Trainer` for ``program`` on ``device`` (``cpu``, ``cuda``, ``cuda:1``).

        ``kernels`` are every available kernel; the lowering picks one per choice
        site by the rule in :class:`KernelInfo`, or takes ``pinned[site]`` when
        given, raising :class:`sexpgpu.errors.CheckpointError` with code
        ``E-CHOICE-001`` when a pinned choice cannot be taken here.
        """


@dataclass(frozen=True)
class LoweringInfo:
    """A lowering: its name, the device kinds it serves, and a lazy factory."""

    name: str
    devices: tuple[str, ...]
    factory: Callable[[], Lowering]
    doc: str = ""


# ---------------------------------------------------------------- kernels


@dataclass(frozen=True)
class KernelInfo:
    """One implementation of a kind of choice site.

    ``kind`` is the site kind (``attention``, ``stack``, ``conv2d``...); ``name``
    is recorded as the choice (``math``, ``sdpa``, ``unrolled``). ``lowering``
    names the lowering that can call it and ``devices`` where it runs.
    Among the kernels that fit (deterministic ones only, unless the run asks
    otherwise), the highest ``priority`` wins, then the name in alphabetical order. ``factory`` returns the callable the
    lowering invokes; its signature is fixed per kind by that lowering.
    """

    kind: str
    name: str
    lowering: str
    devices: tuple[str, ...]
    deterministic: bool
    factory: Callable[[], Callable[..., Any]]
    priority: int = 0
    doc: str = ""


# ---------------------------------------------------------------- optimizers


@dataclass(frozen=True)
class OptimizerInfo:
    """A named optimizer.

    ``options`` maps each option a `.sx` file may give to its default;
    ``state_names`` gives, for the options in use, the states kept per
    parameter (``("m", "v")`` for adam). ``factory`` returns the update object
    the lowering calls; the torch lowering documents its protocol.
    """

    name: str
    options: Mapping[str, Any]
    state_names: Callable[[Mapping[str, Any]], tuple[str, ...]]
    factory: Callable[[], Any]
    doc: str = ""


# ---------------------------------------------------------------- storage


@dataclass(frozen=True)
class ObjectIdentity:
    """What an object is, for pinning: its size and a version (ETag, generation
    or ``sha256:<hex>``)."""

    size: int
    version: str


class Storage(Protocol):
    """A checkpoint location opened by a storage backend.

    Keys are ``/``-separated and relative to the location
    (``step-00000004/params.safetensors``). Every method raises
    :class:`sexpgpu.errors.StorageError` with one clear line on failure.
    """

    uri: str
    """The location as the user wrote it, normalised (no trailing slash)."""

    def describe(self) -> str:
        """A one-line description for messages: the location and the credential source, no secrets."""

    def check_writable(self) -> None:
        """Prove the location can be listed and written (write and delete a probe)."""

    def list_children(self, prefix: str = "") -> list[str]:
        """Names of the immediate children (folders or objects) under ``prefix``."""

    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key``."""

    def read(self, key: str) -> bytes:
        """The whole object at ``key``."""

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (fewer at the end of the object)."""

    def write(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` at ``key`` durably, all or nothing."""

    def write_many(self, items: Mapping[str, bytes | memoryview]) -> None:
        """Store several objects concurrently; returns once every one is stored."""

    def delete(self, key: str) -> None:
        """Remove the object at ``key`` (no error when it is not there)."""

    def identity(self, key: str) -> ObjectIdentity:
        """The object's size and version."""


@dataclass(frozen=True)
class StorageBackendInfo:
    """A storage backend: the URI schemes it opens and a factory taking the URI.
    A plain path has the scheme ``file``."""

    schemes: tuple[str, ...]
    factory: Callable[[str], Storage]
    doc: str = ""


# ---------------------------------------------------------------- metrics


class MetricsSink(Protocol):
    """Receives the metrics stream. Called from the stream's own thread, never the step loop."""

    def write(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Deliver events in order; raising means "try again later"."""

    def close(self) -> None:
        """Flush and release resources; called once after the last write."""


@dataclass(frozen=True)
class MetricsSinkInfo:
    """A metrics sink: a name for ``--metrics-sink`` and a factory taking
    (metrics folder, experiment slug)."""

    name: str
    factory: Callable[[str, str], MetricsSink]
    doc: str = ""


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


@dataclass(frozen=True)
class DataSourceInfo:
    """A data source for ``defdata``.

    ``options`` maps each option to its default. ``fields(options, seq, batch)``
    returns the batch's fields and their types without loading any data (it may
    read a file's header). ``factory(options, seq, batch, seed)`` opens a
    :class:`DataLoader`. ``counts`` says which field's elements count as
    ``tokens`` (``records`` is always the batch size).
    """

    name: str
    options: Mapping[str, Any]
    fields: Callable[[Mapping[str, Any], int, int], Mapping[str, TensorType]]
    factory: Callable[[Mapping[str, Any], int, int, int], DataLoader]
    tokens_field: str | None = "inputs"
    doc: str = ""
    option_docs: Mapping[str, str] = field(default_factory=dict)

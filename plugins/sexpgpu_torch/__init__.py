"""The torch plugin: PyTorch's two lowerings, its kernels, and the optimizers.

- The lowerings ``torch`` (eager; the default on ``cpu``) and ``compiled``
  (``torch.compile``, inductor; the default on ``cuda``, and asked for by name on
  ``cpu``): one trainer, two strategies (:mod:`sexpgpu_torch.lowering`, docs/cuda.md).
- The kernels for either device: attention ``math``/``sdpa``, stacks
  ``unrolled``/``looped``, conv2d ``direct`` (the eager lowering's, which the
  compiled one calls too), and the compiled lowering's ``recompute`` stack.
- The optimizers sgd, adam and adamw, and the torch implementation of every
  built-in op.
- What the lowerings take on the machine: the CPU's summation-order choices
  (``cpu.*``, ``torch.version``), the CUDA switches (``cuda.*``), pinned snapshots.
- What ``sexpgpu run`` takes for them: the options ``--threads``, ``--update`` and ``--shard``
  (recorded choices), and the launcher of ``--devices N`` (torch's elastic agent).

The CUDA-only kernels (SDPA backends, cuDNN engines) are the ``cuda`` plugin's
(``sexpgpu_cuda``), which builds on this one.

Importing this module must stay cheap: torch is imported by the factories only
(every submodule but ``names``, ``cpu_environment`` and ``rng`` imports it at its
top, and is imported here only inside factories).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sexpgpu.choices import SHARD_CHOICE
from sexpgpu.extension import (
    KernelInfo,
    LoweringInfo,
    OptimizerInfo,
    RunOptionInfo,
    module_missing,
)
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ir import SHARDINGS
from sexpgpu_torch.cpu_environment import THREADS
from sexpgpu_torch.names import COMPILED, LOWERING, UPDATE, UPDATES


def _eager_factory() -> Any:
    from sexpgpu_torch.lowering import EagerLowering

    return EagerLowering()


def _compiled_factory() -> Any:
    from sexpgpu_torch.lowering import CompiledLowering

    return CompiledLowering()


# Not named after its submodule: importing sexpgpu_torch.cpu_environment sets the
# package's attribute of that name to the module, which a descriptor built after it
# would then take for this function.
def starting_environment(pins: Mapping[str, str]) -> dict[str, str]:
    """``LoweringInfo.environment`` of a lowering that runs on torch: what ATen, OpenMP
    and MKL must start with to take the pinned CPU choices (imports no torch)."""
    from sexpgpu_torch.cpu_environment import environment_for

    return environment_for(pins)


def join_group(device: str) -> Any:
    """``LoweringInfo.group`` of a lowering whose trainer is this plugin's: the ranks
    torch.distributed joins from the launcher's environment."""
    from sexpgpu_torch.distributed import join

    return join(device)


def launch_ranks(command: Sequence[str], **how: Any) -> tuple[int, str | None]:
    """``LoweringInfo.launch`` of a lowering whose ranks torch.distributed joins: the
    workers started by torch's elastic agent (:mod:`sexpgpu_torch.launcher`)."""
    from sexpgpu_torch.launcher import launch

    return launch(command, **how)


def compile_cache(folder: str) -> dict[str, str]:
    """``LoweringInfo.compile_cache`` of the compiled lowering: inductor's caches (its
    FX graphs, AOTAutograd's, the built C++ kernels) and Triton's kernels in ``folder``.

    Without precompiled C++ headers: inductor builds its header in the machine's
    temporary folder before it looks for a built kernel, so a replay on a machine
    whose temporary folder lacks it would spend seconds building a header it never
    uses; and the switch is part of every cache key, so the bundling and the
    replaying process must agree on it. A process that has already imported torch
    (an embedding program) read the switch then: it is set in torch's config too."""
    import sys

    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.cpp_cache_precompile_headers = False  # type: ignore[attr-defined]
    return {
        "TORCHINDUCTOR_CACHE_DIR": folder,
        "TRITON_CACHE_DIR": f"{folder}/triton",
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
    }


@hookimpl
def sexpgpu_unavailable() -> str | None:
    """Unavailable without torch (looked up, not imported)."""
    return module_missing("torch", "pip install torch (see https://pytorch.org for CUDA builds)")


@hookimpl
def sexpgpu_lowerings() -> list[LoweringInfo]:
    """The eager and the compiled lowering, each for ``cpu`` and ``cuda``."""
    return [
        LoweringInfo(
            name=LOWERING,
            devices=("cpu", "cuda"),
            factory=_eager_factory,
            group=join_group,
            launch=launch_ranks,
            environment=starting_environment,
            doc="PyTorch eager execution of a compiled program (CPU, CUDA)",
            # the reference on the CPU; on CUDA the compiled lowering is the default
            default_for=("cpu",),
            # the only lowering there was before a checkpoint recorded its lowering
            unrecorded=True,
        ),
        LoweringInfo(
            name=COMPILED,
            devices=("cuda", "cpu"),
            factory=_compiled_factory,
            group=join_group,  # the same trainer: the ranks are torch.distributed's
            launch=launch_ranks,
            environment=starting_environment,  # torch's own settings, as eager's are
            doc="torch.compile (inductor) of every graph: loss and backward, update, eval",
            default_for=("cuda",),
            compile_cache=compile_cache,
        ),
    ]


@hookimpl
def sexpgpu_run_options() -> list[RunOptionInfo]:
    """``sexpgpu run --threads N`` and ``--shard``: choices the torch lowerings record."""
    return [
        RunOptionInfo(
            "--threads",
            THREADS,
            minimum=1,
            help="The CPU's intra-op thread count (default: OMP_NUM_THREADS, else torch's, "
            "from the cores this process may use). Recorded, and pinned on resume.",
        ),
        RunOptionInfo(
            "--update",
            UPDATE,
            values=UPDATES,
            help="How the compiled lowering's sgd, adam and adamw update: fused (torch's fused "
            "kernels, the default; nothing to compile) or compiled (one compiled graph, the "
            "eager lowering's terms). Recorded, and pinned on resume.",
        ),
        RunOptionInfo(
            "--shard",
            SHARD_CHOICE,
            values=SHARDINGS,
            help="What several devices shard: none (every device holds everything), optimizer "
            "(the optimizer states) or full (parameters, gradients and states); wins over the "
            "file's :shard. Recorded, and pinned on resume.",
        ),
    ]


def _kernel(name: str) -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        from sexpgpu_torch import kernels

        return getattr(kernels, name)

    return factory


@hookimpl
def sexpgpu_kernels() -> list[KernelInfo]:
    """The kernels for either device; each kind's call contract is in
    :data:`sexpgpu.extension.KERNEL_CALLS`."""
    return [
        KernelInfo(
            kind="attention",
            name="math",
            lowering=LOWERING,
            devices=("cpu", "cuda"),
            deterministic=True,
            factory=_kernel("attention_math"),
            priority=0,
            doc="softmax(QK^T/sqrt(d))V written out, causal mask by masked_fill",
        ),
        KernelInfo(
            kind="attention",
            name="sdpa",
            lowering=LOWERING,
            devices=("cpu", "cuda"),
            # On CUDA the flash/efficient backward passes use atomics; on the CPU
            # it is deterministic but, to keep one rule for both devices, the
            # math kernel is the deterministic default and sdpa is opt-in.
            deterministic=False,
            factory=_kernel("attention_sdpa"),
            priority=10,
            doc="torch.nn.functional.scaled_dot_product_attention",
        ),
        KernelInfo(
            kind="stack",
            name="unrolled",
            lowering=LOWERING,
            devices=("cpu", "cuda"),
            deterministic=True,
            factory=_kernel("stack_unrolled"),
            priority=10,
            doc="a repeat compiled into the graph's lines, iteration by iteration",
            # The lowering emits the iterations itself; the callable is the plain loop.
            inline=True,
        ),
        KernelInfo(
            kind="stack",
            name="looped",
            lowering=LOWERING,
            devices=("cpu", "cuda"),
            deterministic=True,
            factory=_kernel("stack_looped"),
            priority=0,
            doc="a repeat run as a Python loop over its body, once per iteration",
        ),
        KernelInfo(
            kind="conv2d",
            name="direct",
            lowering=LOWERING,
            devices=("cpu", "cuda"),
            deterministic=True,
            factory=_kernel("conv2d_direct"),
            priority=0,
            doc="torch.nn.functional.conv2d",
        ),
        KernelInfo(
            kind="stack",
            name="recompute",
            lowering=COMPILED,
            # nothing CUDA-specific in it: it runs on the CPU as well
            devices=("cuda", "cpu"),
            deterministic=True,
            factory=_kernel("stack_recompute"),
            priority=-10,
            doc="a repeat whose iterations recompute their activations in the backward pass "
            "(activation checkpointing): the recompute budget, per repeat",
        ),
    ]


# ---------------------------------------------------------------- optimizers
#
# The descriptors are plain data so that the compiler can check a `.sx` file's
# options without importing torch. The update objects live in sexpgpu_torch.optim.


def _optimizer_factory(name: str) -> Callable[[], Any]:
    def factory() -> Any:
        from sexpgpu_torch import optim

        return optim.UPDATES[name]()

    return factory


def _sgd_states(options: Mapping[str, Any]) -> tuple[str, ...]:
    return ("momentum",) if float(options.get("momentum", 0.0)) > 0 else ()


def _adam_states(options: Mapping[str, Any]) -> tuple[str, ...]:
    return ("m", "v")


SGD_OPTIONS: Mapping[str, Any] = {
    "lr": 0.01,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "nesterov": False,
}
"""sgd's options and their defaults."""

ADAM_OPTIONS: Mapping[str, Any] = {
    "lr": 1e-3,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
}
"""adam's options and their defaults (``weight_decay`` is L2, added to the gradient)."""

ADAMW_OPTIONS: Mapping[str, Any] = {
    **ADAM_OPTIONS,
    "weight_decay": 0.01,
    "no_decay_tags": ("no-decay",),
}
"""adamw's options and their defaults (decoupled decay, skipped for ``no_decay_tags``)."""


@hookimpl
def sexpgpu_optimizers() -> list[OptimizerInfo]:
    """sgd (with momentum/nesterov), adam and adamw, as propose-then-commit updates."""
    return [
        OptimizerInfo(
            name="sgd",
            options=dict(SGD_OPTIONS),
            state_names=_sgd_states,
            factory=_optimizer_factory("sgd"),
            doc="stochastic gradient descent; state 'momentum' when momentum > 0",
        ),
        OptimizerInfo(
            name="adam",
            options=dict(ADAM_OPTIONS),
            state_names=_adam_states,
            factory=_optimizer_factory("adam"),
            doc="Adam (Kingma & Ba); weight_decay is L2 added to the gradient",
        ),
        OptimizerInfo(
            name="adamw",
            options=dict(ADAMW_OPTIONS),
            state_names=_adam_states,
            factory=_optimizer_factory("adamw"),
            doc="Adam with decoupled weight decay, skipped for parameters tagged no_decay_tags",
        ),
    ]


@hookimpl
def sexpgpu_ops() -> list[Any]:
    """The torch implementations of the built-in ops, whose specs are the core's registry.

    Each factory returns the op's builder from :data:`sexpgpu_torch.ops.IMPLEMENTATIONS`
    (imported, with torch, only when called)."""
    import importlib

    from sexpgpu.extension import OpInfo
    from sexpgpu.lang.ops import builtin_ops

    def factory(name: str) -> Callable[[], Any]:
        return lambda: importlib.import_module("sexpgpu_torch.ops").IMPLEMENTATIONS[name]

    return [OpInfo(s.name, s, {LOWERING: factory(s.name)}, s.doc) for s in builtin_ops()]

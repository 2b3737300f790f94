"""The torch lowering's trainer: parameters, optimizer states, steps, export and restore.

:class:`TorchLowering` chooses a kernel per choice site and builds a
:class:`TorchTrainer`, whose graphs :mod:`sexpgpu_torch.lowering` compiles.

Optimizer states belong to a *state group*: a run of consecutive stages whose
optimizer has the same name and the same options other than ``lr``. Entering a
stage of another group starts its states afresh. Adam's bias correction counts
the updates since the group's first step: ``count = step - group_start`` where
``group_start`` is the number of steps in the stages before the group, so it
needs no saved counter and survives a resume.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sexpgpu.choices import Choices
from sexpgpu.errors import CheckpointError, PluginError, RunError
from sexpgpu.extension import KernelInfo, OpInfo, OptimizerInfo, Supplies, Trainer
from sexpgpu.graph import ParamDecl, Program
from sexpgpu.kernels import choose_kernels, device_kind, recorded
from sexpgpu_torch.cpu import take as take_cpu_choices
from sexpgpu_torch.lowering import LOWERING, TORCH_DTYPES, Ctx, Tensor, compile_graph
from sexpgpu_torch.optim import clip_by_global_norm
from sexpgpu_torch.rng import derive_seed

# ---------------------------------------------------------------- initialisation


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    # Our matrices are used as `x @ W`, so a 2-D [in, out] parameter has fan-in
    # shape[0]; higher ranks follow the conv layout [out, in, k...].
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[2:]))
    return shape[1] * receptive, shape[0] * receptive


def init_tensor(decl: ParamDecl, seed: int) -> Tensor:
    """``decl``'s initial value as an f32 CPU tensor drawn from ``(seed, "init", path)``.

    ``normal(std)``, ``uniform(low, high)``, ``zeros``, ``ones``,
    ``xavier(gain=1)`` (uniform, bound ``gain*sqrt(6/(fan_in+fan_out))``) and
    ``kaiming(gain=sqrt(2))`` (normal, std ``gain/sqrt(fan_in)``).
    """
    shape = tuple(decl.type.shape)
    kind, args = decl.init.kind, tuple(decl.init.args)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(seed, "init", decl.path))
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "normal":
        std = args[0] if args else 1.0
        mean = args[1] if len(args) > 1 else 0.0
        return torch.randn(shape, generator=gen) * std + mean
    if kind == "uniform":
        if len(args) >= 2:
            low, high = args[0], args[1]
        elif args:
            low, high = -args[0], args[0]
        else:
            low, high = 0.0, 1.0
        return torch.rand(shape, generator=gen) * (high - low) + low
    fan_in, fan_out = _fans(shape)
    if kind == "xavier":
        gain = args[0] if args else 1.0
        bound = gain * (6.0 / (fan_in + fan_out)) ** 0.5
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound
    if kind == "kaiming":
        gain = args[0] if args else 2.0**0.5
        return torch.randn(shape, generator=gen) * (gain / fan_in**0.5)
    raise RunError(f"unknown initializer '{kind}' for {decl.path}", pos=decl.pos)


# ---------------------------------------------------------------- the trainer


@dataclass
class Proposal:
    """A step computed but not yet committed: new trainable parameters and states."""

    stage: int
    group: int
    loss_tensor: Tensor
    params: list[Tensor]
    states: dict[str, list[Tensor]]
    _loss: float | None = None

    @property
    def loss(self) -> float:
        """The step's loss (one host sync, on first use)."""
        if self._loss is None:
            self._loss = float(self.loss_tensor)
        return self._loss


def _group_key(stage: Any) -> tuple:
    opt = stage.optimizer
    options = tuple(sorted((k, repr(v)) for k, v in opt.options.items() if k != "lr"))
    return (opt.name, options)


class TorchTrainer(Trainer):
    """The :class:`sexpgpu.extension.Trainer` of the torch lowering."""

    ctx_type: type[Ctx] = Ctx
    """What graphs read besides their values (a subclass may keep parts out of traces)."""

    def __init__(
        self,
        program: Program,
        *,
        device: str,
        chosen: Mapping[str, KernelInfo],
        optimizers: Mapping[str, OptimizerInfo],
        ops: Sequence[OpInfo] = (),
    ) -> None:
        self.program = program
        self.device = torch.device(device)
        self.choices: dict[str, str] = recorded(chosen)
        self.ctx = self.ctx_type(program.run.seed, self.device)
        self.autocast = program.run.precision == "bf16" and self.device.type == "cuda"
        fns = {site: k.factory() for site, k in chosen.items()}
        inline = frozenset(site for site, k in chosen.items() if k.inline)
        self.decls = list(program.params)
        self.trainable = [d.path for d in self.decls if d.trainable]
        self._export_buffers: dict[tuple, dict[str, np.ndarray]] = {}

        # Stages: compiled loss, optimizer update, state group.
        self.stage_loss = [
            compile_graph(s.loss, self.ctx, fns, self.device, inline, ops) for s in program.stages
        ]
        self.updates = []
        self.state_names: list[tuple[str, ...]] = []
        for s in program.stages:
            info = optimizers.get(s.optimizer.name)
            if info is None:
                raise PluginError(
                    f"no installed plugin supplies the optimizer '{s.optimizer.name}'",
                    pos=s.optimizer.pos,
                )
            options = {**info.options, **s.optimizer.options}
            self.updates.append((info.factory(), options))
            self.state_names.append(tuple(info.state_names(options)))
        self.group: list[int] = []
        self.group_start: list[int] = []
        start = 0
        for i, s in enumerate(program.stages):
            if i > 0 and _group_key(s) == _group_key(program.stages[i - 1]):
                self.group.append(self.group[-1])
                self.group_start.append(self.group_start[-1])
            else:
                self.group.append(i)
                self.group_start.append(start)
            start += s.steps
        self.decay: list[list[bool]] = []
        for _, options in self.updates:
            skip = set(options.get("no_decay_tags", ()) or ())
            self.decay.append([not (skip & set(d.tags)) for d in self.decls if d.trainable])
        self.evals = {
            e.name: (e, compile_graph(e.graph, self.ctx, fns, self.device, inline, ops))
            for e in program.evals
        }
        self.fields = [
            {name: TORCH_DTYPES[t.dtype] for name, t in s.data.fields.items()}
            for s in program.stages
        ]
        self._decl_by_path: dict[str, ParamDecl] = {d.path: d for d in self.decls}
        self.params: dict[str, Tensor] = {}
        self.ctx.params = self.params  # the same dict for good: graphs read it by path
        self.states: dict[str, list[Tensor]] = {}
        self.current_group: int | None = None
        self.ranks: Any = None  # the TorchGroup of a data-parallel run (use_group)

    def use_group(self, group: Any) -> None:
        """Train as one rank of ``group`` (a :class:`sexpgpu_torch.distributed.TorchGroup`):
        each step takes this rank's part of the global batch and averages the
        gradients across the ranks. Dropout draws from a seed of its own per rank,
        so the ranks' masks are not the same for their different records."""
        self.ranks = group
        self.ctx.seed = derive_seed(self.program.run.seed, "rank", group.rank)

    # -- parameters

    def _set_param(self, path: str, value: Tensor) -> None:
        decl = self._decl_by_path[path]
        t = value.to(dtype=TORCH_DTYPES[decl.type.dtype]).to(self.device)
        if decl.trainable:
            t.requires_grad_(True)
        self.params[path] = t

    def init_params(self) -> None:
        """Draw every parameter on the CPU from ``(seed, "init", path)``, then move it."""
        for decl in self.decls:
            self._set_param(decl.path, init_tensor(decl, self.program.run.seed))
        self.states = {}
        self.current_group = None

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Replace some parameters by value: the ``:load`` ones the core read, after
        ``init_params`` on a fresh start and after ``restore`` for frozen ones."""
        for path, array in params.items():
            decl = self._decl_by_path.get(path)
            if decl is None:
                raise CheckpointError(f"the program has no parameter {path}")
            self._check_shape(path, array)
            # A writable array is taken as it is (the caller hands it over, per the
            # protocol), so a large pretrained model is not copied once more.
            owned = array.flags.writeable and array.dtype.isnative
            self._set_param(path, torch.from_numpy(array if owned else np.array(array, copy=True)))

    def _check_shape(self, name: str, array: np.ndarray) -> None:
        path = name.split("/", 1)[0]
        want = tuple(self._decl_by_path[path].type.shape)
        if tuple(array.shape) != want:
            raise CheckpointError(
                f"{name} has shape {list(array.shape)} in the checkpoint, the program says {list(want)}"
            )

    # -- a step

    def _inputs(self, batch: Mapping[str, np.ndarray], fields: Mapping[str, torch.dtype]) -> None:
        dev = self.device
        missing = [name for name in fields if name not in batch]
        if missing:
            raise RunError(f"the batch has no field '{missing[0]}' (it has {sorted(batch)})")
        inputs = {}
        for name, array in batch.items():
            t = torch.from_numpy(np.ascontiguousarray(array))
            dt = fields.get(name)
            if dt is not None and t.dtype != dt:
                t = t.to(dt)
            inputs[name] = t.to(dev, non_blocking=True) if dev.type != "cpu" else t
        self.ctx.inputs = inputs

    def propose(
        self, batch: Mapping[str, np.ndarray], *, stage: int, step: int, lr: float
    ) -> Proposal:
        """Forward, backward and the stage's optimizer into new tensors (nothing changes).

        The optimizer's update count (Adam's bias correction) is
        ``step - group_start`` of the stage's state group (see the module docstring).
        """
        ctx = self.ctx
        if self.ranks is not None:  # this rank's part of the global batch
            batch = {name: array[self.ranks.shard(len(array))] for name, array in batch.items()}
        self._inputs(batch, self.fields[stage])
        ctx.step, ctx.training = step, True
        trainable = [self.params[p] for p in self.trainable]
        if self.autocast:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                (loss,) = self.stage_loss[stage]()
        else:
            (loss,) = self.stage_loss[stage]()
        if trainable and loss.requires_grad:
            grads = list(torch.autograd.grad(loss, trainable, allow_unused=True))
        else:  # a loss that reaches no trainable parameter
            grads = [None] * len(trainable)
        for i, g in enumerate(grads):
            if g is None:  # a parameter this stage's loss does not reach
                grads[i] = torch.zeros_like(trainable[i])
        ctx.inputs = {}
        group = self.group[stage]
        update, options = self.updates[stage]
        with torch.no_grad():
            loss = loss.detach()
            if self.ranks is not None:  # before clipping: the norm is the global batch's
                loss = self.ranks.average(grads, loss)
            clip = self.program.stages[stage].optimizer.clip
            if clip is not None and grads:
                clip_by_global_norm(grads, float(clip))
            if group == self.current_group:
                states = self.states
            else:
                states = update.init_states(trainable, options)
            new_params, new_states = update.propose(
                trainable,
                grads,
                states,
                lr=float(lr),
                count=step - self.group_start[stage],
                options=options,
                decay=self.decay[stage],
            )
        return Proposal(stage, group, loss, new_params, new_states)

    def find_non_finite(self, proposal: Proposal) -> tuple[str, str, int] | None:
        """One fused check over every proposed tensor, one host sync; the first offender
        (in parameter order, each parameter before its states) only when it trips."""
        found = self.non_finite_flag(proposal)
        if found is None or not float(found):
            return None
        return self.first_non_finite(proposal)

    def non_finite_flag(self, proposal: Proposal) -> Tensor | None:
        """A one-element device tensor, non-zero when a proposed tensor holds a value
        that is not finite (one kernel per dtype, no host sync); ``None`` when the
        proposal holds no tensor."""
        tensors = list(proposal.params)
        for values in proposal.states.values():
            tensors.extend(values)
        if not tensors:
            return None
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        one = torch.ones(1, dtype=torch.float32, device=self.device)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            # Multiplies by 1.0 in place (a bitwise no-op) and raises `found`.
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
        return found

    def first_non_finite(self, proposal: Proposal) -> tuple[str, str, int] | None:
        """The first proposed tensor with values that are not finite, and how many."""
        names = list(proposal.states)
        for i, path in enumerate(self.trainable):
            candidates = [("parameter", path, proposal.params[i])]
            candidates += [("state", f"{path}/{n}", proposal.states[n][i]) for n in names]
            for kind, name, t in candidates:
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    return kind, name, bad
        return None

    def commit(self, proposal: Proposal) -> None:
        """Make the proposal's parameters and states the current ones."""
        for path, t in zip(self.trainable, proposal.params, strict=True):
            self.params[path] = t.requires_grad_(True)
        self.states = proposal.states
        self.current_group = proposal.group

    # -- checkpoints

    def export(self, *, reuse: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Host copies of the parameters and the current states (bf16 as f32); a
        frozen ``:load`` parameter is left out, as a checkpoint does not copy it.

        The copies land in arrays already laid out as the safetensors files a
        checkpoint writes (``layout_tensors``), so writing them copies nothing more.
        With ``reuse`` the previous export's arrays are overwritten and handed
        back when their layout fits (fresh pages would cost page faults on every
        checkpoint); the caller must be done with them.
        """
        from sexpgpu.checkpoint import layout_tensors

        # A frozen parameter read with :load is named by experiment.json, not copied.
        sources = {d.path: self.params[d.path] for d in self.decls if d.trainable or d.load is None}
        state_sources = {
            f"{path}/{name}": values[i]
            for i, path in enumerate(self.trainable)
            for name, values in self.states.items()
        }

        def copy_out(tensors: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
            specs = {
                name: (
                    tuple(t.shape),
                    "float32" if t.is_floating_point() else str(t.dtype).removeprefix("torch."),
                )
                for name, t in tensors.items()
            }
            key = tuple(specs.items())
            arrays = self._export_buffers.get(key) if reuse else None
            if arrays is None:
                arrays = layout_tensors(specs)
                self._export_buffers[key] = arrays
            self.copy_to_host(arrays, tensors)
            return arrays

        return copy_out(sources), copy_out(state_sources)

    def copy_to_host(self, arrays: Mapping[str, np.ndarray], tensors: Mapping[str, Tensor]) -> None:
        """Copy each of ``tensors`` into the host array of its name; done on return.
        (A lowering for a device with streams may override it to copy asynchronously.)"""
        for name, t in tensors.items():
            torch.from_numpy(arrays[name]).copy_(t.detach())

    def restore(
        self, params: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray], *, stage: int
    ) -> None:
        """Take parameters (all or some: ``:load`` ones may be absent) and ``stage``'s
        states back; empty ``states`` means the stage's states have not started."""
        unknown = [p for p in params if p not in self._decl_by_path]
        if unknown:
            raise CheckpointError(f"the checkpoint holds {unknown[0]}, which the program lacks")
        for path, array in params.items():
            self._check_shape(path, array)
        names = self.state_names[stage]
        new_states: dict[str, list[Tensor]] = {}
        if states:
            expected = {f"{p}/{n}" for p in self.trainable for n in names}
            missing = sorted(expected - set(states))
            extra = sorted(set(states) - expected)
            if missing:
                raise CheckpointError(f"the checkpoint lacks the optimizer state {missing[0]}")
            if extra:
                raise CheckpointError(
                    f"the checkpoint holds the optimizer state {extra[0]}, which this stage does not keep"
                )
            for key, array in states.items():
                self._check_shape(key, array)
            for n in names:
                new_states[n] = [
                    torch.from_numpy(np.array(states[f"{p}/{n}"], dtype=np.float32, copy=True)).to(
                        self.device
                    )
                    for p in self.trainable
                ]
        for path, array in params.items():
            self._set_param(path, torch.from_numpy(np.array(array, copy=True)))
        self.states = new_states
        # With no states given (a checkpoint before the stage's first step) the
        # next step starts them afresh; a stateless optimizer has nothing to start.
        self.current_group = self.group[stage] if states or not names else None

    # -- evaluation

    def evaluate(self, pass_name: str, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Run eval pass ``pass_name`` on one batch: no dropout, no gradients."""
        entry = self.evals.get(pass_name)
        if entry is None:
            raise RunError(f"the program has no eval pass '{pass_name}'")
        decl, run = entry
        self._inputs(batch, {n: TORCH_DTYPES[t.dtype] for n, t in decl.data.fields.items()})
        self.ctx.training = False
        with torch.no_grad():
            if self.autocast:
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    outputs = run()
            else:
                outputs = run()
            values = torch.stack([o.detach().float().reshape(()) for o in outputs]).tolist()
        self.ctx.inputs = {}
        return dict(zip(decl.metrics, values, strict=True))


class TorchLowering:
    """The :class:`sexpgpu.extension.Lowering` for PyTorch on ``cpu`` and ``cuda``."""

    def lower(
        self, program: Program, *, device: str, supplies: Supplies, choices: Choices
    ) -> TorchTrainer:
        """Choose a kernel per site, compile every graph, and build the trainer."""
        kind = device_kind(device)
        if kind not in ("cpu", "cuda"):
            raise PluginError(f"the torch lowering cannot run on '{device}' (cpu or cuda)")
        if kind == "cuda" and not torch.cuda.is_available():
            raise PluginError(f"--device {device}: torch sees no CUDA device here")
        if program.run.deterministic:
            # cuBLAS needs a fixed workspace to be deterministic; set before CUDA starts.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            if kind == "cuda":
                # Makes the ops with a nondeterministic CUDA default (embedding and
                # index backward) take their deterministic path; warn_only keeps an
                # op without one usable rather than failing the run. The CPU ops we
                # use are deterministic already, so the CPU path is left alone.
                torch.use_deterministic_algorithms(True, warn_only=True)
                torch.backends.cudnn.benchmark = False
                torch.backends.cudnn.deterministic = True
        chosen = choose_kernels(
            program, lowering=LOWERING, device=device, kernels=supplies.kernels, choices=choices
        )
        # Before any graph is built: the sums are the pinned threads' from the start.
        cpu_choices = take_cpu_choices(choices.pins(), device)
        trainer = TorchTrainer(
            program,
            device=device,
            chosen=chosen,
            optimizers=supplies.optimizers,
            ops=supplies.ops,
        )
        trainer.choices.update(cpu_choices)
        return trainer

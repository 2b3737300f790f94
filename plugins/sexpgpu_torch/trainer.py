"""The torch plugin's trainer: parameters, optimizer states, steps, export and restore.

One :class:`TorchTrainer` serves both of the plugin's lowerings
(:mod:`sexpgpu_torch.lowering`). Its graphs are compiled into straight-line functions by
:mod:`sexpgpu_torch.graphs`; the :class:`~sexpgpu_torch.strategy.Strategy` it is built
with decides how they run: as they are (``torch``) or through ``torch.compile``
(``compiled``). Its :class:`~sexpgpu_torch.placement.Placement` decides where its
tensors sit: on one device until ``use_group`` places it among ranks by the recorded
choice ``shard`` (:mod:`sexpgpu_torch.placement`).

Optimizer states belong to a *state group*: a run of consecutive stages whose
optimizer has the same name and the same options other than ``lr``. Entering a
stage of another group starts its states afresh. Adam's bias correction counts
the updates since the group's first step: ``count = step - group_start`` where
``group_start`` is the number of steps in the stages before the group, so it
needs no saved counter and survives a resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from sexpgpu.choices import SHARD_CHOICE
from sexpgpu.errors import CheckpointError, PluginError, RunError
from sexpgpu.extension import (
    KernelInfo,
    OpInfo,
    OptimizerInfo,
    OptimizerUpdate,
    RankGroup,
    Trainer,
    with_defaults,
)
from sexpgpu.kernels import recorded
from sexpgpu.lang.ir import Graph, ParamDecl, Program
from sexpgpu_torch.contracts import check_optimizer, check_states
from sexpgpu_torch.decoding import compile_decoders
from sexpgpu_torch.dtypes import TORCH_DTYPES
from sexpgpu_torch.graphs import compile_graph
from sexpgpu_torch.initializers import init_tensor
from sexpgpu_torch.optim import clip_by_global_norm
from sexpgpu_torch.placement import HostCopies, Model, Placement, Single, placement_for
from sexpgpu_torch.rng import derive_seed
from sexpgpu_torch.sampling import Sampler, choose
from sexpgpu_torch.strategy import GraphFn, Strategy

Tensor = torch.Tensor

_STAND_IN_DTYPES: dict[str, Any] = {
    "f32": np.float32,
    "bf16": np.float32,
    "i64": np.int64,
    "bool": np.bool_,
}
"""The host dtype of a stand-in batch field, by IR dtype (a batch holds no bf16)."""


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
        """The step's loss (one host sync, on first use, unless it was read already)."""
        if self._loss is None:
            self._loss = float(self.loss_tensor)
        return self._loss

    def keep_loss(self, value: float) -> None:
        """Keep ``value``, the loss read already (in one transfer with something else),
        as the step's loss: reading ``loss`` then costs no host sync."""
        self._loss = value


def _group_key(stage: Any) -> tuple:
    opt = stage.optimizer
    options = tuple(sorted((k, repr(v)) for k, v in opt.options.items() if k != "lr"))
    return (opt.name, options)


def _state_groups(program: Program) -> tuple[list[int], list[int]]:
    """Per stage: its state group (the index of the group's first stage) and the
    number of steps before that group (see the module docstring)."""
    group: list[int] = []
    group_start: list[int] = []
    start = 0
    for i, s in enumerate(program.stages):
        if i > 0 and _group_key(s) == _group_key(program.stages[i - 1]):
            group.append(group[-1])
            group_start.append(group_start[-1])
        else:
            group.append(i)
            group_start.append(start)
        start += s.steps
    return group, group_start


class TorchTrainer(Trainer):
    """The :class:`sexpgpu.extension.Trainer` of both torch lowerings: ``strategy``
    decides how its graphs and updates run (:mod:`sexpgpu_torch.strategy`), its
    ``placement`` where its tensors sit (one device until :meth:`use_group` places it
    among ranks by ``shard``: :mod:`sexpgpu_torch.placement`).

    ``chosen`` is the kernel of each choice site, ``made`` the lowering's other
    choices to record after them (``cpu.*``, ``cuda.*``...); ``align`` > 0 pads every
    matrix product's inner and outer dimension to a multiple of it (``cuda.align``).
    """

    def __init__(
        self,
        program: Program,
        *,
        device: str,
        chosen: Mapping[str, KernelInfo],
        optimizers: Mapping[str, OptimizerInfo],
        ops: Sequence[OpInfo] = (),
        strategy: Strategy,
        made: Mapping[str, str] | None = None,
        shard: str = "none",
        align: int = 0,
    ) -> None:
        self.program = program
        self.shard = shard
        self.device = torch.device(device)
        self.strategy = strategy
        self.choices: dict[str, str] = {**recorded(chosen), **(made or {})}
        self.reads_loss_late = strategy.reads_loss_late
        self.ctx = strategy.context(program.run.seed, self.device)
        self.ctx.align = align  # read as the graphs are built
        self.autocast = strategy.autocasts(program.run.precision, self.device)
        self._quiet = False  # inside _quietly
        self._fns = {site: k.factory() for site, k in chosen.items()}
        self._ops = ops
        self.decls = list(program.params)
        self.trainable = [d.path for d in self.decls if d.trainable]
        self._host_copies = HostCopies(strategy.copy_to_host)  # export's arrays
        self._compile_graphs(frozenset(site for site, k in chosen.items() if k.inline))
        self.updates: list[tuple[OptimizerUpdate, dict[str, Any]]] = []
        self.state_names: list[tuple[str, ...]] = []
        self.optimizer_infos: list[OptimizerInfo] = []
        trainable_types = [d.type for d in self.decls if d.trainable]
        for s in program.stages:
            info = optimizers.get(s.optimizer.name)
            if info is None:
                raise PluginError(
                    f"no installed plugin supplies the optimizer '{s.optimizer.name}'",
                    pos=s.optimizer.pos,
                )
            options = {**info.options, **s.optimizer.options}
            # with no guard to refuse a proposal, every placement commits the very
            # tensors proposed and nothing reads the ones they replace
            update = strategy.update(
                with_defaults(info.factory(), OptimizerUpdate),
                overwrites=not program.run.guard_finite,
            )
            check_optimizer(info, update, options, trainable_types, s.optimizer.pos)
            self.updates.append((update, options))
            self.optimizer_infos.append(info)
            self.state_names.append(tuple(info.state_names(options)))
        self.group, self.group_start = _state_groups(program)
        self.decay: list[list[bool]] = []
        for _, options in self.updates:
            skip = set(options.get("no_decay_tags", ()) or ())
            self.decay.append([not (skip & set(d.tags)) for d in self.decls if d.trainable])
        self.fields = [
            {name: TORCH_DTYPES[t.dtype] for name, t in s.fields.items()} for s in program.stages
        ]
        self.rank, self.rank_count = 0, 1  # of the ranks (use_group)
        self._shared_generators: frozenset[str] = frozenset()  # what the ranks split (use_group)
        self._decl_by_path: dict[str, ParamDecl] = {d.path: d for d in self.decls}
        self.params: dict[str, Tensor] = {}
        self.ctx.params = self.params  # the same dict for good: graphs read it by path
        self.model = Model(
            program, self._decl_by_path, self.trainable, self.params, self.ctx, self.device
        )
        self.placement: Placement = Single(self.model)
        self.states: dict[str, list[Tensor]] = {}
        self.current_group: int | None = None

    def _compile_graphs(self, inline: frozenset[str]) -> None:
        """Compile every graph of the program: the stages' losses, the eval passes and
        the generators; the repeats at the ``inline`` sites emitted iteration by
        iteration."""
        program, strategy, fns, ops = self.program, self.strategy, self._fns, self._ops
        self._inline = inline

        def graph(g: Graph) -> GraphFn:
            return compile_graph(g, self.ctx, fns, self.device, inline, ops)

        self.stage_loss = [strategy.stage_loss(graph(s.loss), self.ctx) for s in program.stages]
        self.evals = {e.name: (e, strategy.evaluation(graph(e.graph))) for e in program.evals}
        self.samplers = {
            gen.name: Sampler(
                gen,
                strategy.evaluation(graph(gen.logits)),
                strategy.evaluation(graph(gen.reward)) if gen.reward else None,
                self._run_quietly,
                self.device,
                compile_decoders(
                    gen.logits, self.ctx, fns, self.device, ops, partial(choose, gen=gen), strategy
                ),
            )
            for gen in [
                *(s.generator for s in program.stages),
                *(e.generator for e in program.evals),
            ]
            if gen is not None
        }

    # -- placement

    @property
    def exports_together(self) -> bool:
        """Whether ``export`` is a collective of the ranks (the placement's)."""
        return self.placement.exports_together

    @property
    def holds_replicas(self) -> bool:
        """Whether each rank holds the whole model (the placement's)."""
        return self.placement.holds_replicas

    @property
    def evaluates_together(self) -> bool:
        """Whether the first ``evaluate`` or ``generate`` after a step is a collective
        (the placement's)."""
        return self.placement.evaluates_together

    def use_group(self, group: RankGroup) -> None:
        """Train as one rank of ``group`` (a :class:`sexpgpu_torch.distributed.TorchGroup`):
        each step is handed this rank's part of the global batch, and the placement the
        choice ``shard`` names (:mod:`sexpgpu_torch.placement`) shares the work out.
        Dropout draws from a seed of its own per rank, so the ranks' masks are not the
        same for their different records."""
        self.rank, self.rank_count = group.rank, group.size
        self.choices[SHARD_CHOICE] = self.shard  # one device has nothing to shard
        # a stage's generator: each rank makes its part of the records (an eval pass's
        # generates whole batches, each on the rank that evaluates them)
        self._shared_generators = frozenset(
            s.generator.name for s in self.program.stages if s.generator is not None
        )
        placement = placement_for(self.shard, self.model, group)
        placement.check_optimizers(
            [
                (info, update)
                for info, (update, _) in zip(self.optimizer_infos, self.updates, strict=True)
            ]
        )
        inline = placement.inline_sites(self._inline)
        if inline != self._inline:  # some repeats must run iteration by iteration
            self._compile_graphs(inline)
        self.placement = placement
        self.ctx.seed = derive_seed(self.program.run.seed, "rank", group.rank)

    def warm_up(self) -> float | None:
        """Compile every stage's loss, backward and update, and every eval pass, now, as
        the strategy compiles them (the compiled one: on zero stand-ins of the program's
        tensors; nothing of the run changes); the seconds taken, or ``None`` when
        nothing compiles. The run calls it once, before any parameter is set."""
        return self.strategy.warm_up(self._run_every_graph_on_stand_ins, self.device)

    def _run_every_graph_on_stand_ins(self) -> None:
        """One step of each stage and one batch of each eval pass on zeros (valid ids
        for every table, the shapes the run will feed), on the placement's
        ``warm_up_placement`` (replicas compile alone; FSDP2's slices are made here, of
        zeros, and the run's own values then copied in); no parameter or state is left."""
        for decl in self.decls:
            t = torch.zeros(
                decl.type.shape, dtype=TORCH_DTYPES[decl.type.dtype], device=self.device
            )
            self.params[decl.path] = t.requires_grad_(decl.trainable)
        placed, self.placement = self.placement, self.placement.warm_up_placement()
        try:
            parts = self.rank_count
            for stage, decl in enumerate(self.program.stages):  # a rank's part of a batch
                batch = {name: a[: len(a) // parts] for name, a in _zeros(decl.fields).items()}
                first = self.group_start[stage] + 1
                self.propose(batch, stage=stage, step=first, lr=1e-3)
            for eval_pass in self.program.evals:
                self.evaluate(eval_pass.name, _zeros(eval_pass.fields))
            for name, sampler in self.samplers.items():  # a rank's part while training
                self.placement.hold_whole()
                with self._quietly():  # as generate runs it: its tensors are inference ones
                    sampler.warm_up(self.rank_count if name in self._shared_generators else 1)
        finally:
            self.placement.let_go()
            self.placement = placed
            self.params.clear()
            self.states = {}
            self.current_group = None

    # -- parameters

    def _set_param(self, path: str, value: Tensor) -> None:
        decl = self._decl_by_path[path]
        t = value.to(dtype=TORCH_DTYPES[decl.type.dtype]).to(self.device)
        self.placement.set_param(path, t, trainable=decl.trainable)

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
        """Forward, backward and the stage's optimizer into new tensors (nothing changes),
        on ``batch``: on several ranks, this rank's part of the global batch.

        The optimizer's update count (Adam's bias correction) is
        ``step - group_start`` of the stage's state group (see the module docstring).
        """
        ctx, placement = self.ctx, self.placement
        placement.let_go()  # whole parameters an eval pass or a generator held
        self._inputs(batch, self.fields[stage])
        ctx.step, ctx.training = step, True
        self.states = placement.attach(self.states)
        loss, grads = self._loss_and_grads(stage)
        ctx.inputs = {}
        group = self.group[stage]
        update, options = self.updates[stage]
        with torch.no_grad():
            trainable = placement.trainable_tensors()
            clip = self.program.stages[stage].optimizer.clip
            if clip is not None and grads:
                clip_by_global_norm(grads, float(clip), placement.clip_norm_sq())
            mine, grads, decay = (
                placement.mine(trainable),
                placement.mine(grads),
                placement.mine(self.decay[stage]),
            )
            fresh = group != self.current_group
            if fresh:
                states = update.init_states(mine, options)
                self._held_to_contract(stage, states, mine, "init_states")
            else:
                states = self.states
            if mine:
                new_params, new_states = update.propose(
                    mine,
                    grads,
                    states,
                    lr=float(lr),
                    count=step - self.group_start[stage],
                    options=options,
                    decay=decay,
                )
            else:  # a rank owning no parameter (more ranks than parameters) updates nothing
                new_params, new_states = [], states
            if fresh:  # the first proposal of these states: once, not every step
                self._held_to_contract(stage, new_states, mine, "propose")
            new_params = placement.share(new_params, trainable)  # every rank's new values
        return Proposal(stage, group, loss, new_params, new_states)

    def _stage_loss(self, stage: int) -> Tensor:
        if self.autocast:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                (loss,) = self.stage_loss[stage]()
        else:
            (loss,) = self.stage_loss[stage]()
        return loss

    def _loss_and_grads(self, stage: int) -> tuple[Tensor, list[Tensor]]:
        """The stage's loss on this batch and its gradient for each of the placement's
        trainable tensors (zeros for one the loss does not reach)."""
        return self.placement.loss_and_grads(partial(self._stage_loss, stage))

    def _held_to_contract(
        self, stage: int, states: Any, params: Sequence[Tensor], made_by: str
    ) -> None:
        decl = self.program.stages[stage].optimizer
        options = self.updates[stage][1]
        check_states(self.optimizer_infos[stage], states, params, options, decl.pos, made_by)

    def find_non_finite(self, proposal: Proposal) -> tuple[str, str, int] | None:
        """One fused check over every proposed tensor, one host sync (the compiled
        strategy reads the step's loss in the same transfer); the first offender (in
        parameter order, each parameter before its states) only when it trips."""
        found = self.non_finite_flag(proposal)
        if found is None or not self.strategy.read_flag(found, proposal):
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
            k = self.placement.state_position(i)
            if k is not None:
                candidates += [("state", f"{path}/{n}", proposal.states[n][k]) for n in names]
            for kind, name, t in candidates:
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    return kind, name, bad
        return None

    def commit(self, proposal: Proposal) -> None:
        """Make the proposal's parameters and states the current ones."""
        proposal.params = self.placement.commit(proposal.params)
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
        checkpoint); the caller must be done with them. The placement gathers what
        other ranks hold (a collective where ``exports_together``).
        """
        return self.placement.export(self.states, self._host_copies, reuse=reuse)

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
                    self.placement.slice_state(
                        torch.from_numpy(
                            np.array(states[f"{p}/{n}"], dtype=np.float32, copy=True)
                        ).to(self.device)
                    )
                    for p in self.placement.mine(self.trainable)
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
        self._inputs(batch, {n: TORCH_DTYPES[t.dtype] for n, t in decl.fields.items()})
        self.placement.hold_whole()
        outputs = self._run_quietly(run, self.ctx.inputs)
        with torch.no_grad():
            values = torch.stack([o.detach().float().reshape(()) for o in outputs]).tolist()
        return dict(zip(decl.metrics, values, strict=True))

    def _run_quietly(self, run: GraphFn, inputs: Mapping[str, Tensor]) -> list[Tensor]:
        """``run`` on ``inputs`` as an eval pass runs (:meth:`_quietly`), in the quiet
        stretch already entered if there is one (a generation's trips)."""
        if self._quiet:
            self.ctx.inputs = dict(inputs)
            return run()
        with self._quietly():
            return self._run_quietly(run, inputs)

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        """Everything run inside runs as an eval pass does: no dropout, no gradients,
        the strategy watching for graphs compiled again; entered once for a whole
        generation, whose trips run a few hundred microseconds each.

        Under ``torch.inference_mode``: what it makes is read and thrown away, never
        differentiated, so torch keeps no version counts or views for autograd
        (a generator's trips, some 150 small ops each, run 7% faster than under
        ``no_grad``)."""
        if self._quiet:
            yield
            return
        self.ctx.training, self._quiet = False, True
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )
        try:
            with torch.inference_mode(), self.strategy.watching(), autocast:
                yield
        finally:
            self.ctx.inputs, self._quiet = {}, False

    # -- generation

    def generate(
        self,
        generator: Any,
        batch: Mapping[str, np.ndarray],
        *,
        seed: int,
        draw: tuple[Any, ...],
        stopping: Any,
    ) -> dict[str, np.ndarray] | None:
        """The records ``generator`` makes from ``batch``'s prompts (see
        :mod:`sexpgpu_torch.sampling`); ``None`` when abandoned at a stop.

        A stage's generator on several ranks gets the rank's part of the step's
        prompts and makes their records, with draws of its own (the rank joins the
        draw); its step then takes them. An eval pass's gets whole batches."""
        sampler = self.samplers.get(generator.name)
        if sampler is None:
            raise RunError(f"the program has no generator '{generator.name}'")
        if generator.name in self._shared_generators:  # a rank's part of the prompts
            draw = (*draw, "rank", self.rank)
        self.placement.hold_whole()
        with self._quietly():
            return sampler.records(batch, seed=seed, draw=draw, stopping=stopping)


def _zeros(fields: Mapping[str, Any]) -> dict[str, np.ndarray]:
    # a batch of zeros: valid ids for every table, and the shapes the run will feed
    return {
        name: np.zeros(t.shape, dtype=_STAND_IN_DTYPES.get(t.dtype, np.float32))
        for name, t in fields.items()
    }

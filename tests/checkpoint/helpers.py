"""Helpers for the checkpoint tests: a small hand-built Program and checkpoints of it,
written through the real local storage backend."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from sexpgpu import checkpoint as ckpt
from sexpgpu.errors import Pos
from sexpgpu.lang.ir import (
    Init,
    Knob,
    LoadSpec,
    ParamDecl,
    Program,
    RunSettings,
    Source,
    TensorType,
)

CORE_SHA = "e4f1b2681fd7e21aa5cfe45f6f1b42618f70206f8af4becbf5adb1472edd09d9"
RUN_SHA = "1a74f5546c852533510ab69ca07859527eb813001fc991db683c1ed1013f1117"
POS = Pos("my-run.sx", 1, 1)


def param(
    path: str,
    shape: Iterable[int],
    *,
    dtype: str = "f32",
    trainable: bool = True,
    tags: Iterable[str] = (),
    load: LoadSpec | None = None,
) -> ParamDecl:
    """A parameter declaration as the compiler would make it."""
    return ParamDecl(
        path=path,
        type=TensorType(tuple(shape), dtype),
        init=Init("normal", (0.02,)),
        trainable=trainable,
        tags=tuple(tags),
        load=load,
        pos=POS,
    )


def make_program(**changes) -> Program:
    """The tiny model of the spec's examples: embed, head, a frozen noise vector."""
    program = Program(
        file="my-run.sx",
        sources=(Source("<core>", None, CORE_SHA), Source("my-run.sx", "/x/my-run.sx", RUN_SHA)),
        knobs=(
            Knob("lr", 0.5, 0.5, "default"),
            Knob("steps", 4, 4, "default"),
        ),
        variant=None,
        params=(
            param("model.embed", (32, 8)),
            param("model.head", (8, 32), tags=("no-decay",)),
            param("model.noise", (8,), trainable=False),
        ),
        run=RunSettings(
            name="my-run",
            checkpoint_every=2,
            seed=7,
            precision="f32",
            counters=("tokens",),
            guard_finite=False,
        ),
        stages=(),
        evals=(),
        sites=(),
    )
    return replace(program, **changes)


def adam_states(program: Program) -> dict[str, tuple[str, ...]]:
    """Adam's state names for every trainable parameter."""
    return {p.path: ("m", "v") for p in program.params if p.trainable}


def tensors_for(program: Program, seed: int = 0):
    """Random parameters and optimizer states of the right shapes."""
    rng = np.random.default_rng(seed)
    params = {p.path: rng.standard_normal(p.type.shape, dtype=np.float32) for p in program.params}
    states = {
        f"{path}/{name}": rng.standard_normal(params[path].shape, dtype=np.float32)
        for path, names in adam_states(program).items()
        for name in names
    }
    return params, states


LOADED = {"size": 16, "version": "sha256:" + "a" * 64}
"""The stand-in identity of every ``:load`` file a checkpoint written here pins."""


def write(storage, program: Program, step: int = 4, *, finished: bool = False, seed: int = 0):
    """Write a checkpoint of ``program`` at ``step``; returns (key, params, states, state, experiment)."""
    params, states = tensors_for(program, seed)
    state = ckpt.state_record(
        step=step,
        stage=0,
        records=16 * step,
        counters={"tokens": 512 * step},
        loader={"epoch": 0, "index": step},
        seed=7,
    )
    experiment = ckpt.experiment_record(
        program,
        choices={"stack:model.blocks": "unrolled"},
        slug="my-run-3f9a1c",
        devices=1,
        nodes=1,
        finished=finished,
        state_names=adam_states(program),
        # a :load parameter's file as a run pins it (a stand-in identity)
        loaded={p.path: LOADED for p in program.params if p.load is not None},
    )
    key = ckpt.write_checkpoint(storage, step, params, states, state, experiment)
    return key, params, states, state, experiment


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

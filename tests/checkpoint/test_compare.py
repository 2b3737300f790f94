"""compare_for_resume: what a resume refuses, and the lines it records for what moved."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sexpgpu import checkpoint as ckpt
from sexpgpu.errors import CheckpointError
from sexpgpu.lang.ir import Knob, Source

from .helpers import CORE_SHA, RUN_SHA, adam_states, make_program, param

NEW_SHA = "b05c928e631c" + "0" * 52


def recorded(program=None, **kwargs):
    program = program or make_program()
    return ckpt.experiment_record(
        program,
        choices={},
        slug="s-000000",
        devices=kwargs.get("devices", 1),
        nodes=kwargs.get("nodes", 1),
        finished=False,
        state_names=adam_states(program),
    )


def compare(record, program, devices=1, nodes=1):
    return ckpt.compare_for_resume(
        record, program, devices=devices, nodes=nodes, state_names=adam_states(program)
    )


def test_same_program_moves_nothing():
    assert compare(recorded(), make_program()) == []


def test_edited_sources_and_knobs_are_allowed_and_named():
    old = make_program(
        sources=(
            Source("<core>", None, CORE_SHA),
            Source("my-run.sx", "/a", "91d77bdc76be" + "1" * 52),
        )
    )
    new = make_program(
        sources=(
            Source("<core>", None, CORE_SHA),
            Source("my-run.sx", "/a", NEW_SHA),
            Source("lib.sx", "/lib.sx", "abcdef012345" + "2" * 52),
        ),
        knobs=(
            Knob("lr", 0.25, 0.5, "command line"),
            Knob("steps", 6, 4, "command line"),
        ),
    )
    assert compare(recorded(old), new) == [
        "source my-run.sx 91d77bdc76be -> b05c928e631c",
        "source lib.sx - -> abcdef012345",
        "knob lr 0.5 -> 0.25",
        "knob steps 4 -> 6",
    ]


def test_gone_sources_and_knobs_and_equal_numbers():
    old = make_program(
        sources=(Source("<core>", None, CORE_SHA), Source("lib.sx", "/l", RUN_SHA)),
        knobs=(
            Knob("lr", 0.5, 0.5, "default"),
            Knob("warm", True, True, "default"),
            Knob("steps", 4, 4, "default"),
        ),
    )
    new = make_program(
        sources=(Source("<core>", None, CORE_SHA),),
        knobs=(
            Knob("lr", 0.5, 0.5, "default"),
            Knob("steps", 4.0, 4, "variant"),
            Knob("wd", 0.1, 0.1, "default"),
        ),
    )
    assert compare(recorded(old), new) == [
        "source lib.sx 1a74f5546c85 -> -",
        "knob warm true -> -",
        "knob wd - -> 0.1",
    ]


def test_every_offending_parameter_is_named():
    old = make_program()
    new = make_program(
        params=(
            param("model.embed", (32, 16)),  # another shape
            param("model.head", (8, 32), dtype="bf16", trainable=False),  # dtype, frozen
            param("model.noise", (8,), trainable=True),  # trains where it was frozen
            param("model.extra", (4,)),  # new
        )
    )
    with pytest.raises(CheckpointError) as caught:
        compare(recorded(old), new)
    assert caught.value.code == "E-CKPT-004"
    assert str(caught.value) == (
        "E-CKPT-004: this program's parameters are not the checkpoint's:\n"
        "  model.embed: shape [32, 8] -> [32, 16]\n"
        "  model.head: dtype f32 -> bf16, trains -> frozen\n"
        "  model.noise: frozen -> trains\n"
        "  model.extra: new (not in the checkpoint)\n"
        "resume with the program that wrote the checkpoint, or start the run again"
    )


def test_a_gone_parameter_is_refused():
    old = make_program()
    new = make_program(params=old.params[:2])
    with pytest.raises(
        CheckpointError, match=r"model.noise: gone \(in the checkpoint, not in this program\)"
    ):
        compare(recorded(old), new)


def test_other_optimizer_states_are_refused():
    program = make_program()
    record = recorded(program)
    with pytest.raises(CheckpointError, match=r"model.embed: optimizer states m, v -> m\n"):
        ckpt.compare_for_resume(
            record,
            program,
            devices=1,
            nodes=1,
            state_names={"model.embed": ("m",), "model.head": ("m", "v")},
        )


@pytest.mark.parametrize(
    "devices,nodes,said",
    [
        (2, 1, "written by 1 device on 1 node and this run has 2 devices on 1 node"),
        (1, 2, "written by 1 device on 1 node and this run has 1 device on 2 nodes"),
    ],
)
def test_another_device_or_node_count_is_E_DP_002(devices, nodes, said):
    with pytest.raises(CheckpointError) as caught:
        compare(recorded(), make_program(), devices=devices, nodes=nodes)
    assert caught.value.code == "E-DP-002"
    assert str(caught.value).startswith("E-DP-002: the checkpoint was ")
    assert said in str(caught.value)


def test_a_variant_change_alone_moves_only_its_knobs():
    new = replace(
        make_program(variant="big"),
        knobs=(Knob("lr", 0.5, 0.5, "variant"), Knob("steps", 4, 4, "default")),
    )
    assert compare(recorded(), new) == []

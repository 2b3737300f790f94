"""Which lowering a run takes, as units (no torch): by name, pinned by a checkpoint,
or the device kind's default; what two lowerings conflict on; and which plugin
supplies the built-in lowerings and CUDA kernels, as `sexpgpu plugins` lists them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sexpgpu.choices import Choices
from sexpgpu.errors import CheckpointError, PluginError
from sexpgpu.extension import LoweringInfo
from sexpgpu.kernels import choose_lowering
from sexpgpu.plugin_supplies import defaults_of, find_conflicts
from sexpgpu_cli.describing import describe
from tests.e2e.helpers import run_sexpgpu

HOOK = "sexpgpu_lowerings"


def _choose(lowerings, *, device, requested, pinned):
    """``choose_lowering`` as a run calls it: ``--lowering requested`` against a
    checkpoint's ``pinned`` choices."""
    choices = Choices.make(
        requested={"lowering": requested} if requested else {},
        asked={"lowering": f"--lowering {requested}"} if requested else {},
        recorded=pinned,
    )
    return choose_lowering(lowerings, device=device, choices=choices)


def _lowering(name: str, devices: tuple[str, ...], default_for=None) -> LoweringInfo:
    return LoweringInfo(name, devices, lambda: None, default_for=default_for)


EAGER = _lowering("torch", ("cpu", "cuda"), ("cpu",))
COMPILED = _lowering("compiled", ("cuda", "cpu"), ("cuda",))
BUILT_IN = [EAGER, COMPILED]


def test_the_built_ins_serve_both_kinds_without_a_conflict() -> None:
    claims = [(EAGER, "torch", "sexpgpu 0.1"), (COMPILED, "cuda", "sexpgpu 0.1")]
    assert find_conflicts(HOOK, claims) == []
    assert describe(HOOK, COMPILED)["default_for"] == ["cuda"]


def test_two_defaults_for_one_kind_conflict_and_a_lowering_without_default_for_claims_all() -> None:
    other = _lowering("mine", ("cpu",))  # a third party's, as written before default_for
    assert defaults_of(other) == ("cpu",)
    claims = [(EAGER, "torch", "sexpgpu 0.1"), (other, "mine", "mine 1.0")]
    (conflict,) = find_conflicts(HOOK, claims)
    assert conflict.what == "lowering for 'cpu' devices"
    assert (
        "E-PLUGIN-001" in conflict.message()
        and "SEXPGPU_DISABLE_PLUGINS=mine" in conflict.message()
    )
    # serving a kind without being its default is no claim on it
    polite = _lowering("mine", ("cpu",), default_for=())
    assert find_conflicts(HOOK, [(EAGER, "torch", "sexpgpu 0.1"), (polite, "mine", "m 1")]) == []


@pytest.mark.parametrize(
    ("device", "requested", "pinned", "taken"),
    [
        ("cpu", None, None, None),  # the kind's default, found by the plugin machinery
        ("cpu", "compiled", None, "compiled"),
        ("cuda:1", "torch", None, "torch"),
        ("cpu", None, {"lowering": "compiled"}, "compiled"),
        ("cpu", "compiled", {"lowering": "compiled", "cpu.threads": "2"}, "compiled"),
    ],
)
def test_the_lowering_taken(device, requested, pinned, taken) -> None:
    chosen = _choose(BUILT_IN, device=device, requested=requested, pinned=pinned)
    assert (chosen.name if chosen else None) == taken


def test_another_lowering_than_the_recorded_one_is_e_choice_001() -> None:
    with pytest.raises(CheckpointError) as caught:
        _choose(BUILT_IN, device="cpu", requested="compiled", pinned={"lowering": "torch"})
    assert caught.value.code == "E-CHOICE-001"
    assert caught.value.message == (
        "the recorded choice 'torch' for lowering cannot be taken with --lowering compiled "
        "(use --choices fresh to choose again)"
    )


def test_a_recorded_lowering_not_installed_here_is_e_choice_001() -> None:
    with pytest.raises(CheckpointError) as caught:
        _choose([EAGER], device="cpu", requested=None, pinned={"lowering": "compiled"})
    assert caught.value.code == "E-CHOICE-001"
    assert "'compiled' for lowering" in caught.value.message
    assert "no such lowering is installed" in caught.value.message


def test_an_unknown_or_unfit_requested_lowering_is_a_plugin_error() -> None:
    with pytest.raises(PluginError, match="--lowering compild: no installed plugin"):
        _choose(BUILT_IN, device="cpu", requested="compild", pinned=None)
    cuda_only = _lowering("graphs", ("cuda",))
    with pytest.raises(PluginError, match="does not run on cpu"):
        _choose([cuda_only], device="cpu", requested="graphs", pinned=None)


def test_the_torch_plugin_supplies_both_lowerings_and_the_cuda_plugin_cuda_kernels_for_both(
    tmp_path: Path,
) -> None:
    done = run_sexpgpu("plugins", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    supplies = {entry["name"]: entry["supplies"] for entry in json.loads(done.stdout)}
    lowerings = {info["name"]: info["default_for"] for info in supplies["torch"]["lowerings"]}
    assert lowerings == {"torch": ["cpu"], "compiled": ["cuda"]}
    compiled_own = [k for k in supplies["torch"]["kernels"] if k["lowering"] == "compiled"]
    assert [(k["kind"], k["name"], k["devices"]) for k in compiled_own] == [
        ("stack", "recompute", ["cuda", "cpu"])
    ]
    assert list(supplies["cuda"]) == ["kernels"]
    cuda_kernels = {(k["kind"], k["name"]) for k in supplies["cuda"]["kernels"]}
    assert cuda_kernels == {
        ("attention", "flash"),
        ("attention", "cudnn"),
        ("attention", "efficient"),
        ("attention", "sdpa-math"),
        ("conv2d", "cudnn"),
        ("conv2d", "cudnn-benchmark"),
    }
    # each for both lowerings: eager on a GPU takes flash as compiled does
    assert sorted((k["kind"], k["name"], k["lowering"]) for k in supplies["cuda"]["kernels"]) == (
        sorted((kind, name, lowering) for kind, name in cuda_kernels
               for lowering in ("compiled", "torch"))
    )  # fmt: skip
    assert all(k["devices"] == ["cuda"] for k in supplies["cuda"]["kernels"])

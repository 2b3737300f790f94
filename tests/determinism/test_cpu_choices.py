"""The CPU choices as units: the pins a run hands its lowering, the environment set
before torch starts, the processor check, and what the torch lowering records and
refuses (spec: Pinned; docs/determinism.md)."""

from __future__ import annotations

import os

import pytest
import torch

from sexpgpu import opening as environment
from sexpgpu.errors import CheckpointError
from sexpgpu.opening import Selection, Target
from sexpgpu_torch import cpu as torch_cpu
from sexpgpu_torch import cpu_environment as cpu
from tests.catalogs import project


def threads_asked(threads: int | None, *, fresh: bool = False) -> Target:
    """The target of ``sexpgpu run --threads N`` (as the CLI makes it)."""
    if threads is None:
        return Target(fresh=fresh)
    return Target(
        requests={"cpu.threads": str(threads)}, options={"cpu.threads": "--threads"}, fresh=fresh
    )


RECORDED = {
    "attention:model.attn": "math",
    "cpu.threads": "1",
    "cpu.capability": "default",
    "cpu.blas.cbwr": "AUTO",
}

CPUINFO_AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
CPUINFO_AVX512 = CPUINFO_AVX2.replace("fma", "fma avx512f avx512bw avx512vl avx512dq")


@pytest.fixture
def threads_kept():
    """torch's thread count is the process's: give it back after a test sets it."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("recorded", "fresh", "threads", "pins"),
    [
        (None, False, None, {}),
        (None, False, 3, {"cpu.threads": "3"}),
        (RECORDED, False, None, RECORDED),
        (RECORDED, True, None, {}),
        (RECORDED, True, 2, {"cpu.threads": "2"}),
        (RECORDED, False, 1, RECORDED),
        ({}, False, None, {}),
    ],
)
def test_pins_for_a_run(recorded, fresh, threads, pins) -> None:
    assert threads_asked(threads, fresh=fresh).choices(None, recorded).pins() == pins


def test_threads_against_a_pinned_resume_with_another_count_is_e_choice_001() -> None:
    with pytest.raises(CheckpointError) as caught:
        threads_asked(2).choices(None, RECORDED)
    assert caught.value.code == "E-CHOICE-001"
    assert "cpu.threads" in caught.value.message and "--threads 2" in caught.value.message


@pytest.mark.parametrize(
    ("capability", "cpuinfo", "has"),
    [
        ("default", "", True),
        ("avx2", CPUINFO_AVX2, True),
        ("avx512", CPUINFO_AVX2, False),
        ("avx512", CPUINFO_AVX512, True),
        ("sve256", CPUINFO_AVX512, False),
        ("bogus", CPUINFO_AVX512, False),
    ],
)
def test_processor_has_reads_the_flags_torch_needs(monkeypatch, capability, cpuinfo, has) -> None:
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert cpu.processor_has(capability, cpuinfo) is has


def test_environment_for_sets_only_what_the_processor_can_take(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "processor_has", lambda capability: capability != "avx512")
    env = cpu.environment_for(RECORDED)
    # MKL's mode is not handed over in MKL_CBWR, which cannot say "off": the
    # lowering sets it through MKL itself (test_mkl_mode.py)
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"}
    assert "ATEN_CPU_CAPABILITY" not in cpu.environment_for({"cpu.capability": "avx512"})
    assert cpu.environment_for({"attention:model.attn": "math"}) == {}
    # a count no machine runs is not handed to OpenMP: the lowering refuses it
    assert cpu.environment_for({"cpu.threads": "99999999999"}) == {}
    assert cpu.environment_for({"cpu.threads": "x2"}) == {}


def test_the_environment_is_pinned_before_torch_from_the_checkpoint(monkeypatch) -> None:
    recorded = dict(RECORDED)
    monkeypatch.setattr(environment, "checkpoint_choices", lambda catalog, resume, where: recorded)
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "MKL_CBWR"):
        # set first, so that monkeypatch puts back what was there (or nothing) afterwards
        monkeypatch.setenv(variable, "unset")
        monkeypatch.delenv(variable)

    def prepare(target: Target, resume: str) -> dict[str, str]:
        return environment.prepare_environment(
            project(), Selection("x.sx"), target, resume=resume, checkpoint_dir=None
        )

    env = prepare(Target(), "ckpt/step-00000004")
    assert env["OMP_NUM_THREADS"] == "1" and env["ATEN_CPU_CAPABILITY"] == "default"
    assert os.environ["OMP_NUM_THREADS"] == "1"
    # --choices fresh: nothing pinned, and a conflict is left for the run to report
    assert prepare(Target(fresh=True), "x") == {}
    assert prepare(threads_asked(5), "x") == {}
    # the lowering the run takes says what its libraries need: one recorded elsewhere
    recorded["lowering"] = "not-installed"
    assert prepare(Target(), "x") == {}


def test_recorded_choices_of_a_missing_checkpoint_is_none(tmp_path) -> None:
    assert environment.checkpoint_choices(project(), str(tmp_path / "nothing"), None) is None
    assert environment.checkpoint_choices(project(), "latest", str(tmp_path)) is None


def test_the_torch_lowering_records_what_torch_runs_with() -> None:
    now = torch_cpu.current("cpu")
    assert set(now) >= {"cpu.threads", "cpu.capability", "cpu.blas", "torch.version"}
    assert now["cpu.threads"] == str(torch.get_num_threads())
    assert now["cpu.capability"] == torch.backends.cpu.get_cpu_capability().lower()
    assert now["torch.version"] == torch.__version__
    assert now["cpu.blas"].startswith("mkl") == torch.backends.mkl.is_available()
    assert ("cpu.blas.cbwr" in now) == now["cpu.blas"].startswith("mkl")
    assert torch_cpu.current("cuda:0") == {"torch.version": torch.__version__}


def test_a_pinned_thread_count_is_set(threads_kept) -> None:
    other = 1 if threads_kept != 1 else 2
    taken = torch_cpu.take({"cpu.threads": str(other), "stack:model.blocks": "unrolled"}, "cpu")
    assert torch.get_num_threads() == other
    assert taken["cpu.threads"] == str(other)
    assert "stack:model.blocks" not in taken


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cpu.capability", "sve256"),
        ("cpu.blas", "openblas"),
        ("torch.version", "1.0.0"),
        ("cpu.threads", "many"),
        ("cpu.threads", "0"),
        ("cpu.threads", "99999999999"),  # a forged record: no overflow, one line
    ],
)
def test_a_pin_torch_does_not_take_is_e_choice_001(threads_kept, name, value) -> None:
    with pytest.raises(CheckpointError) as caught:
        torch_cpu.take({name: value}, "cpu")
    assert caught.value.code == "E-CHOICE-001"
    assert f"'{value}' for {name}" in caught.value.message
    assert "--choices fresh" in caught.value.message
    assert "\n" not in caught.value.message


def test_cpu_pins_are_ignored_on_another_device(threads_kept) -> None:
    taken = torch_cpu.take({"cpu.capability": "sve256", "cpu.threads": "7"}, "cuda")
    assert taken == {"torch.version": torch.__version__}
    assert torch.get_num_threads() == threads_kept

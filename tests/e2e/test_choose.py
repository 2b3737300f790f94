"""`sexpgpu run --choose SITE=KERNEL` as a user runs it: the kernel asked for is
taken and recorded, a resume pins it, `--choose` against the record is refused
unless `--choices fresh`, and every mistake is one line with its exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import refused_in_process
from tests.foundation.pluginkit import make_plugin

from .helpers import EXAMPLES, events, experiments, run_sexpgpu, sexpgpu_env

ATTENTION, STACK = "attention:model.blocks.attn", "stack:model.blocks"
# tiny-lm as a user makes it non-deterministic: `sdpa` (priority 10) is then the
# rule's attention kernel, so `math` is there only when asked for
FAST = ["--steps", "4", "--set", "checkpoint-every=2", "--metrics-dir", "m"]


def _choices(checkpoint: Path) -> dict[str, str]:
    return json.loads((checkpoint / "experiment.json").read_text())["choices"]


def _one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-lm twice (deterministic as shipped, and `:deterministic false`), and a
    4-step run of the second that chose by kind (attention) and by full site name
    (stack, against its kind)."""
    root = tmp_path_factory.mktemp("choose")
    source = (EXAMPLES / "tiny-lm.sx").read_text()
    (root / "det.sx").write_text(source)
    (root / "nd.sx").write_text(
        source.replace("  :seed 1\n", "  :seed 1\n  :deterministic false\n")
    )
    chose = run_sexpgpu(
        "run", "nd.sx", *FAST, "--checkpoint-dir", "chose",
        "--choose", "attention=math", "--choose", "stack=unrolled",
        "--choose", f"{STACK}=looped",
        cwd=root,
    )  # fmt: skip
    assert chose.returncode == 0, chose.stderr
    return root


def test_a_choice_by_kind_and_by_site_is_taken_recorded_and_shown(project: Path) -> None:
    choices = _choices(project / "chose" / "step-00000004")
    assert (choices[ATTENTION], choices[STACK], choices["lowering"]) == ("math", "looped", "torch")
    shown = run_sexpgpu("checkpoint", "chose/step-00000004", cwd=project)
    assert shown.returncode == 0, shown.stderr
    assert f"  {ATTENTION}  math" in shown.stdout
    assert f"  {STACK}           looped" in shown.stdout


def test_a_resume_pins_the_choice_and_may_repeat_it(project: Path) -> None:
    resumed = run_sexpgpu(
        "run", "nd.sx", *FAST, "--checkpoint-dir", "pinned",
        "--resume", str(project / "chose" / "step-00000002"), "--choose", "attention=math",
        cwd=project,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    choices = _choices(project / "pinned" / "step-00000004")
    assert (choices[ATTENTION], choices[STACK]) == ("math", "looped")


def test_choose_against_the_record_is_refused_unless_fresh(project: Path) -> None:
    resume = ["--resume", str(project / "chose" / "step-00000002")]
    refused = refused_in_process(
        "run", "nd.sx", *FAST, "--checkpoint-dir", "refused", *resume, "--choose", "stack=unrolled",
        cwd=project,
    )  # fmt: skip
    assert refused.returncode == 1
    assert _one_line(refused) == (
        f"sexpgpu run: E-CHOICE-001: the recorded choice 'looped' for {STACK} cannot be taken "
        "with --choose stack=unrolled (use --choices fresh to choose again)"
    )
    assert not (project / "refused").exists() or not any((project / "refused").iterdir())

    fresh = run_sexpgpu(
        "run", "nd.sx", *FAST, "--checkpoint-dir", "fresh", *resume, "--choices", "fresh",
        "--choose", "stack=unrolled", "--metrics-dir", "m-fresh",
        cwd=project,
    )  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr
    choices = _choices(project / "fresh" / "step-00000004")
    # the request wins; attention, asked for nothing, takes the rule's kernel again
    assert (choices[ATTENTION], choices[STACK]) == ("sdpa", "unrolled")
    (run_dir,) = experiments(project / "m-fresh")
    resumed = [e["text"] for e in events(run_dir) if e["kind"] == "annotation"][0].split("\n")
    assert f"choice {ATTENTION} math -> sdpa" in resumed
    assert f"choice {STACK} looped -> unrolled" in resumed


def test_the_workers_of_a_data_parallel_run_take_it(project: Path) -> None:
    # the launcher hands the command line to its workers: each rank chooses alike
    ran = run_sexpgpu(
        "run", "nd.sx", "--steps", "2", "--metrics-dir", "m-dp", "--checkpoint-dir", "dp",
        "--devices", "2", "--choose", "stack=looped",
        cwd=project,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    choices = _choices(project / "dp" / "step-00000002")
    assert (choices[ATTENTION], choices[STACK]) == ("sdpa", "looped")


MISTAKES = [
    (["--choose", "attention"], 2, "--choose takes SITE=KERNEL or KIND=KERNEL, got 'attention'"),
    (
        ["--choose", "atention=math"],
        2,
        "--choose atention=math: the program has no choice site or kind 'atention' (did you "
        f"mean 'attention'? its sites: {ATTENTION}, {STACK}; kinds: attention, stack)",
    ),
    (
        ["--choose", "lowering=compiled"],
        2,
        "--choose lowering=compiled: lowering is not a kernel choice site; use --lowering",
    ),
    (
        ["--choose", "attention=flash"],
        1,
        "--choose attention=flash: no attention kernel 'flash' for the torch lowering on cpu "
        "(kernels that fit: math, sdpa (not deterministic); see `sexpgpu check`)",
    ),
    (
        ["--choose", "attention=sdpa"],
        1,
        "--choose attention=sdpa: the attention kernel 'sdpa' is not deterministic and this "
        "run is (add :deterministic false to its defrun to take it)",
    ),
]


MISTAKE_IDS = ["malformed", "unknown-site", "not-a-site", "unknown-kernel", "not-deterministic"]


@pytest.mark.parametrize(("args", "code", "line"), MISTAKES, ids=MISTAKE_IDS)
def test_a_mistake_is_one_line_and_nothing_runs(
    project: Path, args: list[str], code: int, line: str
) -> None:
    result = run_sexpgpu("run", "det.sx", *FAST, "--checkpoint-dir", "mistake", *args, cwd=project)
    assert result.returncode == code, result.stderr
    assert _one_line(result) == f"sexpgpu run: {line}"
    assert not (project / "mistake").exists() or not any((project / "mistake").iterdir())


def test_check_lists_the_sites_and_their_kernels(project: Path) -> None:
    checked = run_sexpgpu("check", "det.sx", cwd=project)
    assert checked.returncode == 0, checked.stderr
    lines = checked.stdout.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith("choice sites")))
    sites = lines[start : lines.index("parameters:")]
    assert f"  attention: {ATTENTION}" in sites and f"  stack: {STACK}" in sites
    rows = {tuple(ln.split()[:3]) for ln in sites if ln.startswith("    ")}
    assert {("math", "torch", "lowering"), ("looped", "torch", "lowering")} <= rows
    sdpa = next(ln for ln in sites if ln.split()[0] == "sdpa")
    assert "non-deterministic (:deterministic false)" in sdpa
    assert lines[-1] == "38 parameters, 27,024 values (27,024 trainable)"


# A third party's stack kernel that the rule never takes (priority -5): it counts its
# calls in a file, so a run shows whether the kernel it records is the one it called.
COUNTING_STACK = """
import os

from sexpgpu.extension import KernelInfo
from sexpgpu.hookspecs import hookimpl


def _counting():
    def run(body, carry, per_iteration_slots):
        with open(os.environ["COUNTING_STACK_CALLS"], "a") as calls:
            calls.write("call\\n")
        for slot_tensors in per_iteration_slots:
            carry = body(carry, slot_tensors)
        return carry

    return run


@hookimpl
def sexpgpu_kernels():
    return [KernelInfo(kind="stack", name="counting", lowering="torch", devices=("cpu",),
                       deterministic=True, factory=_counting, priority=-5)]
"""


def test_a_third_party_kernel_the_rule_never_takes_can_be_asked_for(project: Path) -> None:
    site = make_plugin(
        project / "site", "counting-stack", {"counting_stack": COUNTING_STACK},
        {"counting-stack": "counting_stack"},
    )  # fmt: skip
    calls = project / "calls.txt"
    env = sexpgpu_env(PYTHONPATH=str(site), COUNTING_STACK_CALLS=str(calls))
    checked = run_sexpgpu("check", "det.sx", cwd=project, env=env)
    assert any(ln.split()[:2] == ["counting", "torch"] for ln in checked.stdout.splitlines())
    ran = run_sexpgpu(
        "run", "det.sx", "--steps", "2", "--metrics-dir", "m-3p", "--checkpoint-dir", "third",
        "--choose", "stack=counting",
        cwd=project, env=env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert _choices(project / "third" / "step-00000002")[STACK] == "counting"
    assert len(calls.read_text().splitlines()) >= 2  # called by each step (and eval pass)

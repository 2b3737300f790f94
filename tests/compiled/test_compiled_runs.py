"""The compiled lowering on the CPU, as a user runs it: `sexpgpu run --lowering compiled`.

One module-scoped set of runs of a small transformer (dropout, a frozen parameter,
an eval pass, a cosine schedule, clipping) serves every test. With no finite guard,
the fused AdamW update writes into the parameters and states themselves (the guarded
path, into copies, gives the same bits: tests/torch/test_fused_update.py):

- ``full``: 6 compiled steps, checkpoints at 3 and 6;
- ``part``: the step-3 checkpoint of ``full`` resumed without ``--lowering`` (the
  recorded lowering is taken), to step 6;
- ``eager``: the same 6 steps on the eager lowering;
- ``fresh``: eager's step-3 checkpoint resumed with ``--lowering compiled --choices fresh``;
- ``graph``: ``full`` with ``--update compiled`` (the update as one compiled graph);
- ``graph-old``: its step-3 checkpoint with no ``optimizer.update`` recorded (as
  written before the choice was), resumed to step 6;
- ``guard``: a compiled run with the finite guard whose learning rate makes the first
  proposal infinite.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from sexpgpu_torch.recompiles import RECOMPILED
from tests.compiled.conftest import run_named
from tests.e2e.helpers import events, experiments, run_sexpgpu

PROGRAM = """
(defknob steps 6)
(defknob lr 0.01)
(defknob guard false)
(defmodel gpt (vocab seq dim heads layers)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.02))
  (param bias [vocab] :init (uniform -0.1 0.1) :frozen true)
  (layer blocks (repeat layers (transformer-block dim heads)))
  (layer norm (layer-norm dim))
  (layer head (linear dim vocab))
  (forward (ids) (+ (-> (dropout (+ (embed ids) pos) 0.1) blocks norm head) bias)))
(defdata train (sort :vocab 16) :seq 8 :batch 8)
(defrun lm
  :model (gpt 16 8 16 2 1)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adamw :lr lr :schedule (cosine :warmup 2 :min-lr 0.001) :clip 1.0)
  :steps steps
  :checkpoint-every 3
  :seed 3
  :guard-finite guard
  :evals ((eval probe :every 3 :data train :batches 1 :metrics (loss accuracy))))
"""

THREE, SIX = "step-00000003", "step-00000006"

# the module's runs compile a program (about a minute cold on 2 cores)
# The module's runs are made by its first test's setup: several processes each
# allowed 600 s (tests/compiled/conftest.run_named); the suite's 300 s per test would
# cut them off on a loaded machine (it did: a setup timed out at 300 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _run(folder: Path, env: dict[str, str], name: str, *args: str):
    return run_named(folder, env, "lm.sx", name, *args)


def _copy_step(folder: Path, source: str, step: str, target: str) -> Path:
    shutil.copytree(folder / source / step, folder / target / step)
    return folder / target / step


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, compiled_env: dict[str, str]):
    folder = tmp_path_factory.mktemp("compiled")
    (folder / "lm.sx").write_text(PROGRAM)
    done = {"full": _run(folder, compiled_env, "full", "--lowering", "compiled")}
    _copy_step(folder, "full", THREE, "part")
    done["part"] = _run(folder, compiled_env, "part", "--resume", "latest")
    done["eager"] = _run(folder, compiled_env, "eager")
    _copy_step(folder, "eager", THREE, "fresh")
    done["fresh"] = _run(
        folder,
        compiled_env,
        "fresh",
        "--resume",
        "latest",
        "--lowering",
        "compiled",
        "--choices",
        "fresh",
    )
    done["graph"] = _run(
        folder, compiled_env, "graph", "--lowering", "compiled", "--update", "compiled"
    )
    step = _copy_step(folder, "graph", THREE, "graph-old")
    experiment = _experiment(step)
    del experiment["choices"]["optimizer.update"]
    (step / "experiment.json").write_text(json.dumps(experiment))
    done["graph-old"] = _run(folder, compiled_env, "graph-old", "--resume", "latest")
    for name, result in done.items():
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    # the same graphs (the rate enters as an input), so torch's caches serve it
    done["guard"] = _run(
        folder,
        compiled_env,
        "guard",
        "--lowering",
        "compiled",
        "--set",
        "lr=1e39",
        "--set",
        "guard=true",
    )
    return folder, done


def _experiment(step_dir: Path) -> dict:
    return json.loads((step_dir / "experiment.json").read_text())


def _tensors(step_dir: Path) -> dict[str, np.ndarray]:
    params = load_file(str(step_dir / "params.safetensors"))
    states = load_file(str(step_dir / "states.safetensors"))
    return {**params, **states}


def _points(metrics: Path, name: str) -> dict[int, float]:
    (run_dir,) = experiments(metrics)
    return {
        e["step"]: e["value"]
        for e in events(run_dir)
        if e.get("kind") == "point" and e.get("name") == name
    }


def _log(result, event: str) -> dict:
    lines = [json.loads(ln) for ln in result.stderr.splitlines() if ln.startswith("{")]
    return next(line for line in lines if line.get("event") == event)


def test_a_compiled_run_trains_as_the_eager_one_within_float_tolerance(runs):
    folder, _ = runs
    compiled, eager = (
        _points(folder / "metrics-full", "loss"),
        _points(folder / "metrics-eager", "loss"),
    )
    assert sorted(compiled) == sorted(eager) == [1, 2, 3, 4, 5, 6]
    assert compiled[6] < compiled[1]  # it learns
    for step in compiled:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4, abs=1e-5)
    ours, theirs = _tensors(folder / "full" / SIX), _tensors(folder / "eager" / SIX)
    assert ours.keys() == theirs.keys()
    # atol: a key bias has no gradient but rounding noise, which Adam scales up
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-3, atol=1e-4, err_msg=name)
    # the compiled eval pass reports the same numbers too
    probe = _points(folder / "metrics-full", "probe/loss")
    assert probe.keys() == {3, 6}
    eager_probe = _points(folder / "metrics-eager", "probe/loss")
    assert probe[6] == pytest.approx(eager_probe[6], rel=1e-4)


def _order(metrics: Path) -> list[tuple]:
    # Points only: a checkpoint's annotation comes when its background write is
    # stored, at no fixed place among them.
    (run_dir,) = experiments(metrics)
    return [(e["kind"], e["name"], e["step"]) for e in events(run_dir) if e["kind"] == "point"]


def test_no_graph_compiles_again_after_warm_up(runs):
    # dropout masks, a frozen parameter, an eval pass, a schedule, a resume, the guard:
    # each graph keeps the code its warm-up compiled (sexpgpu_torch.recompiles)
    _, done = runs
    for name, result in done.items():
        assert RECOMPILED not in result.stderr, f"{name}: {result.stderr[-3000:]}"


def test_losses_read_a_step_late_keep_the_eager_runs_order_of_events(runs):
    # The compiled trainer reads each loss once the next step is queued; every
    # pass, checkpoint and the end report the step's loss first.
    folder, _ = runs
    order = _order(folder / "metrics-full")
    assert order == _order(folder / "metrics-eager")
    losses = [step for kind, name, step in order if (kind, name) == ("point", "loss")]
    assert losses == [1, 2, 3, 4, 5, 6]


def test_a_resume_is_bit_exact_to_the_uninterrupted_compiled_run(runs):
    folder, _ = runs
    resumed, uninterrupted = _tensors(folder / "part" / SIX), _tensors(folder / "full" / SIX)
    assert resumed.keys() == uninterrupted.keys()
    assert all(resumed[k].tobytes() == uninterrupted[k].tobytes() for k in resumed)
    losses = _points(folder / "metrics-full", "loss")
    assert _points(folder / "metrics-part", "loss") == {s: losses[s] for s in (4, 5, 6)}


def test_the_lowering_and_its_choices_are_recorded_and_pinned(runs):
    folder, done = runs
    recorded = _experiment(folder / "full" / THREE)["choices"]
    assert recorded["lowering"] == "compiled"
    assert recorded["compile.backend"] == "inductor"
    assert recorded["optimizer.update"] == "fused"
    assert recorded["attention:model.blocks.attn"] == "math"  # deterministic: no sdpa
    assert not any(name.startswith("cuda.") for name in recorded)  # nothing CUDA on the CPU
    # the resume took the recorded lowering without being told, and every other choice
    assert _experiment(folder / "part" / SIX)["choices"] == recorded
    assert _log(done["part"], "run resumed")["choices"]["lowering"] == "compiled"
    assert _experiment(folder / "eager" / SIX)["choices"]["lowering"] == "torch"
    # compiling is paid before the first step, and `run started` says how long it took
    started = _log(done["full"], "run started")
    assert started["compile_seconds"] > 0
    # whole graphs: nothing fell back to eager (dropout's masks come in as inputs)
    assert all("graph breaks" not in result.stderr for result in done.values())


def test_the_update_as_a_compiled_graph_and_a_checkpoint_that_recorded_none(runs):
    folder, _ = runs
    # --update compiled is recorded; fused and compiled train alike, in other bits
    assert _experiment(folder / "graph" / SIX)["choices"]["optimizer.update"] == "compiled"
    graph, fused = (
        _points(folder / "metrics-graph", "loss"),
        _points(folder / "metrics-full", "loss"),
    )
    assert all(abs(graph[s] - fused[s]) <= 1e-4 * abs(fused[s]) for s in fused)
    # a checkpoint written before the choice was recorded ran the compiled graph: its
    # resume takes it, records it, and is bit-exact
    old = _experiment(folder / "graph-old" / SIX)["choices"]
    assert old["optimizer.update"] == "compiled"
    resumed, uninterrupted = _tensors(folder / "graph-old" / SIX), _tensors(folder / "graph" / SIX)
    assert all(resumed[k].tobytes() == uninterrupted[k].tobytes() for k in uninterrupted)


def test_update_against_the_record_or_on_the_eager_lowering_is_refused(runs, compiled_env):
    folder, _ = runs
    _copy_step(folder, "graph", THREE, "refused-graph")
    refused = _run(folder, compiled_env, "refused-graph", "--resume", "latest", "--update", "fused")
    assert refused.returncode != 0, refused.stderr[-2000:]
    (line,) = [ln for ln in refused.stderr.splitlines() if "E-CHOICE-001" in ln]
    assert "'compiled' for optimizer.update cannot be taken with --update fused" in line
    # the eager lowering has no such choice: a usage error, one line
    _copy_step(folder, "eager", THREE, "refused-eager")
    refused = _run(folder, compiled_env, "refused-eager", "--resume", "latest", "--update", "fused")
    assert refused.returncode == 2, refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("sexpgpu run: --update fused: the eager lowering updates with its own ")
    assert "Traceback" not in refused.stderr


def test_an_eager_checkpoint_resumed_compiled_is_refused_unless_fresh(runs, compiled_env):
    folder, done = runs
    _copy_step(folder, "eager", THREE, "refused")
    refused = _run(folder, compiled_env, "refused", "--resume", "latest", "--lowering", "compiled")
    assert refused.returncode != 0
    (line,) = [ln for ln in refused.stderr.splitlines() if "E-CHOICE-001" in ln]
    assert "'torch' for lowering" in line and "--lowering compiled" in line
    assert "--choices fresh" in line and "Traceback" not in refused.stderr
    assert sorted(p.name for p in (folder / "refused").iterdir()) == [THREE]
    # with --choices fresh it continues compiled, and says the lowering moved
    assert _experiment(folder / "fresh" / SIX)["choices"]["lowering"] == "compiled"
    (run_dir,) = experiments(folder / "metrics-fresh")
    notes = [e["text"] for e in events(run_dir) if e.get("kind") == "annotation"]
    assert any("choice lowering torch -> compiled" in note for note in notes)


def test_a_checkpoint_without_the_record_is_eager(runs, compiled_env):
    folder, _ = runs
    step = _copy_step(folder, "eager", THREE, "old")
    experiment = _experiment(step)
    del experiment["choices"]["lowering"]  # as written before the lowering was recorded
    (step / "experiment.json").write_text(json.dumps(experiment))
    refused = _run(folder, compiled_env, "old", "--resume", "latest", "--lowering", "compiled")
    assert refused.returncode != 0
    assert "E-CHOICE-001" in refused.stderr and "'torch' for lowering" in refused.stderr


def test_a_cuda_choice_on_the_cpu_is_refused(runs, compiled_env):
    folder, _ = runs
    step = _copy_step(folder, "full", THREE, "gpu")
    experiment = _experiment(step)
    experiment["choices"]["cuda.tf32"] = "off"  # as a run on a GPU records it
    (step / "experiment.json").write_text(json.dumps(experiment))
    refused = _run(folder, compiled_env, "gpu", "--resume", "latest")
    assert refused.returncode != 0
    (line,) = [ln for ln in refused.stderr.splitlines() if "E-CHOICE-001" in ln]
    assert "'off' for cuda.tf32" in line and "a CUDA choice on cpu" in line


def test_the_fused_guard_refuses_a_non_finite_proposal_and_names_it(runs):
    folder, done = runs
    refused = done["guard"]
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("sexpgpu run: step 1: the proposed parameter of model.embed.table has ")
    assert last.endswith(" values that are not finite; nothing was committed")
    assert not (folder / "guard").exists() or not any((folder / "guard").iterdir())


def _evaluate(folder: Path, env: dict[str, str], metrics: str, *args: str):
    return run_sexpgpu(
        "evaluate", f"full/{SIX}", "--metrics-dir", metrics, *args, cwd=folder, env=env
    )


def _evaluated(folder: Path, metrics: str) -> dict[str, float]:
    (run_dir,) = experiments(folder / metrics)
    return {
        e["name"]: e["value"]
        for e in events(run_dir)
        if e.get("kind") == "point" and e.get("source") == "evaluate"
    }


def test_evaluate_compiles_only_the_eval_pass_it_runs(runs, compiled_env):
    # torch's dynamo log names each function it traces: evaluate traces one graph,
    # the eval pass (a run traces the loss and the update as well)
    folder, _ = runs
    result = _evaluate(folder, {**compiled_env, "TORCH_LOGS": "dynamo"}, "metrics-evaluated")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("torchdynamo start tracing") == 1
    probe = _points(folder / "metrics-full", "probe/loss")
    assert _evaluated(folder, "metrics-evaluated")["probe/loss"] == probe[6]


def test_evaluate_takes_another_lowering_when_asked(runs, compiled_env):
    folder, _ = runs
    result = _evaluate(folder, compiled_env, "metrics-eager-eval", "--lowering", "torch")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torchdynamo" not in result.stderr and "choice lowering compiled -> torch" in (
        result.stderr
    )
    ran = _points(folder / "metrics-full", "probe/loss")
    assert _evaluated(folder, "metrics-eager-eval")["probe/loss"] == pytest.approx(ran[6], rel=1e-4)
    (run_dir,) = experiments(folder / "metrics-eager-eval")
    notes = [e["text"] for e in events(run_dir) if e.get("kind") == "annotation"]
    assert any("choice lowering compiled -> torch" in note for note in notes)
    # a lowering nobody supplies: the line `run --lowering` gives
    wrong = _evaluate(folder, compiled_env, "metrics-wrong", "--lowering", "compild")
    (line,) = wrong.stderr.strip().splitlines()
    assert wrong.returncode != 0 and line.startswith("sexpgpu evaluate: --lowering compild: ")
    assert "no installed plugin supplies that lowering" in line

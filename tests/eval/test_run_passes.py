"""In-run eval passes come from the `eval` plugin: disabled, interrupted, extended."""

from __future__ import annotations

import json
import signal

from tests.e2e.helpers import (
    events,
    refused_in_process,
    run_sexpgpu,
    sexpgpu_env,
    start_sexpgpu,
    wait_for_step,
)
from tests.foundation.pluginkit import make_plugin

from .kit import RUN, eval_points, one_line, the_run


def test_disabled_a_run_without_passes_trains_and_one_with_passes_stops_before_step_1(workdir):
    env = sexpgpu_env(SEXPGPU_DISABLE_PLUGINS="eval")
    text = (workdir / "eval.sx").read_text()
    start = text.index("  :evals")
    (workdir / "plain.sx").write_text(text[:start].rstrip() + ")\n")
    plain = run_sexpgpu("run", "plain.sx", "--metrics-dir", "m0", cwd=workdir, env=env)
    assert plain.returncode == 0, plain.stderr
    result = refused_in_process(*RUN, cwd=workdir, env=env)
    assert result.returncode == 1
    assert one_line(result.stderr) == (
        "eval.sx:20:11: E-EVAL-001: eval passes (:evals) cannot run: no available plugin "
        "supplies them, and SEXPGPU_DISABLE_PLUGINS disables eval"
    )
    assert not list((workdir / "ck").glob("step-*")) and not (workdir / "m").exists()


def test_an_unknown_metric_is_one_positioned_line(workdir):
    text = (workdir / "eval.sx").read_text().replace("(loss))))", "(los))))")
    (workdir / "eval.sx").write_text(text)
    result = refused_in_process(*RUN, cwd=workdir)
    assert result.returncode == 1
    assert one_line(result.stderr).startswith(
        "eval.sx:22:42: unknown metric los (did you mean 'loss'?): a metric is one of "
        "accuracy, bits-per-char, generated-length, loss, perplexity, reward, top-k-accuracy, "
        "or (name expression)"
    )


METRIC_PLUGIN = """
from sexpgpu.extension import EvalMetricInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_eval_metrics():
    return [
        EvalMetricInfo("error-rate", "(- 1 (accuracy logits targets))", doc="1 - accuracy"),
        EvalMetricInfo("loss-squared", "loss", lambda mean: mean * mean, doc="a test"),
    ]
"""


def test_a_third_party_metric_is_computed_in_the_run_and_by_evaluate(workdir, tmp_path):
    plugin = make_plugin(
        tmp_path / "p",
        "sexpgpu-error-rate",
        {"sexpgpu_error_rate": METRIC_PLUGIN},
        {"error-rate": "sexpgpu_error_rate"},
    )
    env = sexpgpu_env(PYTHONPATH=str(plugin))
    text = (
        (workdir / "eval.sx").read_text().replace("(loss))))", "(loss error-rate loss-squared))))")
    )
    (workdir / "eval.sx").write_text(text)
    result = run_sexpgpu(*RUN, cwd=workdir, env=env)
    assert result.returncode == 0, result.stderr
    ran = eval_points(workdir, source=None)
    (loss,), (error,), (squared,) = (
        ran[(6, f"final/{m}")] for m in ("loss", "error-rate", "loss-squared")
    )
    assert squared == loss * loss
    assert 0.0 <= error <= 1.0
    evaluate = run_sexpgpu(
        "evaluate",
        "ck/step-00000006",
        "--pass",
        "final",
        "--metrics-dir",
        "m",
        cwd=workdir,
        env=env,
    )
    assert evaluate.returncode == 0, evaluate.stderr
    again = eval_points(workdir, source="evaluate")
    assert again[(6, "final/error-rate")] == [error]
    assert again[(6, "final/loss-squared")] == [squared]
    # without the plugin, the metric is unknown: one line, as any unknown metric
    result = run_sexpgpu("evaluate", "ck/step-00000006", "--metrics-dir", "m", cwd=workdir)
    assert "unknown metric error-rate" in one_line(result.stderr)


def test_a_signal_in_the_last_steps_pass_ends_as_any_interrupted_run(workdir):
    # a long final pass, so that the signal comes while it runs
    text = (
        (workdir / "eval.sx")
        .read_text()
        .replace(
            "(eval final :every 3 :metrics (loss))",
            "(eval final :every 6 :batches 100000 :metrics (loss))",
        )
    )
    (workdir / "eval.sx").write_text(text)
    proc = start_sexpgpu(*RUN, cwd=workdir)
    try:
        wait_for_step(workdir / "m", 6, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "sexpgpu run: interrupted by SIGTERM at step 6" in err
    run_dir = the_run(workdir)
    kinds = [e["kind"] for e in events(run_dir)]
    assert "done" not in kinds
    assert json.loads((run_dir / "status.json").read_text())["state"] == "interrupted"
    last = workdir / "ck" / "step-00000006"
    assert json.loads((last / "state.json").read_text())["evals_pending"] == ["final"]
    assert json.loads((last / "experiment.json").read_text())["finished"] is False
    assert (6, "final/loss") not in eval_points(workdir, source=None)
    # the resume runs the pass, then ends finished with done and a finished checkpoint
    text = text.replace(":batches 100000", ":batches 1")
    (workdir / "eval.sx").write_text(text)
    resumed = run_sexpgpu(*RUN, "--resume", "latest", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["kind"] for e in events(run_dir)].count("done") == 1
    assert eval_points(workdir, source=None)[(6, "final/loss")]
    assert json.loads((last / "state.json").read_text())["evals_pending"] == []
    assert json.loads((last / "experiment.json").read_text())["finished"] is True
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"

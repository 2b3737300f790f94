"""What `sexpgpu run` tells a person: step lines off a terminal, eval numbers, the closing
summary, a progress bar that stays on a terminal, the warning without a checkpoint
location, and a finished run started again changing nothing."""

from __future__ import annotations

import json
import os
import pty
import subprocess

import pytest

from tests.e2e.helpers import refused_in_process

from .helpers import REPO, SEXPGPU, events, experiments, run_sexpgpu, sexpgpu_env, status


def records(stderr: str) -> list[dict]:
    """The JSON log records on stderr (the tests run with SEXPGPU_LOG_FORMAT=json)."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def named(stderr: str, event: str) -> list[dict]:
    return [r for r in records(stderr) if r.get("event") == event]


def test_off_a_terminal_each_step_line_has_the_loss_lr_and_throughput(workdir):
    result = run_sexpgpu(
        "run", "examples/my-run.sx", "--metrics-dir", "m", "--log-every", "1", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    lines = named(result.stderr, "step")
    (run_dir,) = experiments(workdir / "m")
    points = {(e["name"], e["step"]): e["value"] for e in events(run_dir) if e["kind"] == "point"}
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert line["steps"] == 4 and line["level"] == "info"
        assert line["loss"] == round(points[("loss", line["step"])], 6)
        assert line["lr"] == points[("lr", line["step"])]
        assert line["steps_per_s"] > 0 and line["tokens_per_s"] > 0


def test_log_every_bounds_the_step_lines(workdir):
    args = ["run", "examples/my-run.sx", "--metrics-dir", "m", "--steps", "7"]
    by_steps = run_sexpgpu(*args, "--log-every", "3", cwd=workdir)
    assert by_steps.returncode == 0, by_steps.stderr
    # the first step of the process, then every 3 steps after it
    assert [r["step"] for r in named(by_steps.stderr, "step")] == [1, 4, 7]
    # the default (30s) logs the first step and then none in a run this short
    default = run_sexpgpu(*args, cwd=workdir)
    assert [r["step"] for r in named(default.stderr, "step")] == [1]


def test_a_bad_log_every_is_one_line(workdir):
    result = refused_in_process("run", "examples/my-run.sx", "--log-every", "3x", cwd=workdir)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "sexpgpu run: --log-every takes steps (100), seconds (30s)" in result.stderr


def test_eval_numbers_are_logged_when_they_land_and_in_the_summary(workdir):
    # tiny-lm's probe pass, every 2 steps instead of every 50
    source = (workdir / "examples" / "tiny-lm.sx").read_text()
    assert ":every 50" in source
    (workdir / "probe.sx").write_text(source.replace(":every 50", ":every 2"))
    result = run_sexpgpu("run", "probe.sx", "--steps", "4", "--metrics-dir", "m2", cwd=workdir)
    assert result.returncode == 0, result.stderr
    (run_dir,) = experiments(workdir / "m2")
    points = {(e["name"], e["step"]): e["value"] for e in events(run_dir) if e["kind"] == "point"}
    evals = named(result.stderr, "eval")
    assert [(r["step"], r["eval_pass"]) for r in evals] == [(2, "probe"), (4, "probe")]
    for r in evals:
        assert r["loss"] == round(points[("probe/loss", r["step"])], 6)
        assert r["accuracy"] == round(points[("probe/accuracy", r["step"])], 6)
    (summary,) = named(result.stderr, "run finished")
    assert summary["eval"]["probe"]["loss"] == round(points[("probe/loss", 4)], 6)


def test_the_summary_says_what_the_run_did(workdir):
    result = run_sexpgpu(
        "run", "examples/my-run.sx", "--metrics-dir", "m", "--checkpoint-dir", "ckpt", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    (run_dir,) = experiments(workdir / "m")
    stream = events(run_dir)
    (summary,) = named(result.stderr, "run finished")
    last_loss = [e["value"] for e in stream if e["kind"] == "point" and e["name"] == "loss"][-1]
    tokens = [e["value"] for e in stream if e["kind"] == "point" and e["name"] == "tokens"][-1]
    assert summary["step"] == summary["steps"] == summary["steps_run"] == 4
    assert summary["loss"] == round(last_loss, 6)
    assert summary["seconds"] > 0
    assert summary["tokens_per_s"] == pytest.approx(tokens / summary["seconds"], rel=0.05)
    assert summary["checkpoint"].endswith("ckpt/step-00000004")
    assert summary["metrics"] == os.path.join("m", run_dir.name, "events.jsonl")
    assert summary["status"] == os.path.join("m", run_dir.name, "status.json")
    assert "undelivered_events" not in summary


def test_without_a_location_the_run_warns_once_at_the_start(workdir):
    result = run_sexpgpu("run", "examples/my-run.sx", "--metrics-dir", "m", cwd=workdir)
    assert result.returncode == 0, result.stderr
    logged = records(result.stderr)
    warnings = [r for r in logged if r["level"] == "warning"]
    assert [w["event"] for w in warnings] == [
        "no checkpoint location: nothing will be saved, and a signal or a crash loses the run"
    ]
    assert warnings[0]["hint"] == "--checkpoint-dir or SEXPGPU_CHECKPOINT_DIR"
    assert logged.index(warnings[0]) < logged.index(named(result.stderr, "run started")[0])
    with_location = run_sexpgpu(
        "run", "examples/my-run.sx", "--metrics-dir", "m", "--checkpoint-dir", "c", cwd=workdir
    )
    assert [r for r in records(with_location.stderr) if r["level"] == "warning"] == []


def test_on_a_terminal_the_progress_bar_stays_at_the_end(workdir):
    master, slave = pty.openpty()
    env = sexpgpu_env(TERM="xterm", COLUMNS="120")
    env.pop("SEXPGPU_LOG_FORMAT")
    proc = subprocess.Popen(
        [
            *SEXPGPU,
            "run",
            "examples/my-run.sx",
            "--metrics-dir",
            "m",
            "--steps",
            "6",
            "--log-every",
            "1",
        ],
        cwd=workdir,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other end closed: the process is gone
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 0
    text = out.decode(errors="replace")
    # the bar's last state is drawn, then a new line keeps it on screen, then the summary
    last = text.rindex("6/6")
    assert "loss " in text[last:] and "tok/s" in text[last:]
    assert text.index("\r\n", last) < text.index("run finished")
    # no step lines on a terminal, even with --log-every 1: the bar shows them
    assert "steps_per_s" not in text


def test_a_finished_run_started_again_changes_nothing(workdir):
    args = ["run", "examples/my-run.sx", "--checkpoint-dir", "ckpt", "--metrics-dir", "m"]
    first = run_sexpgpu(*args, "--resume", "latest", cwd=workdir)
    assert first.returncode == 0, first.stderr
    (run_dir,) = experiments(workdir / "m")
    before = ((run_dir / "events.jsonl").read_bytes(), (run_dir / "status.json").read_bytes())
    again = run_sexpgpu(*args, "--resume", "latest", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "sexpgpu run: finished: ckpt/step-00000004 is step 4 of 4; nothing to do" in (
        again.stderr
    )
    after = ((run_dir / "events.jsonl").read_bytes(), (run_dir / "status.json").read_bytes())
    assert after == before
    assert [e["kind"] for e in events(run_dir)].count("done") == 1
    assert status(run_dir)["state"] == "finished"
    assert sorted(p.name for p in (workdir / "ckpt").iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]


def test_steps_takes_what_its_help_shows(workdir):
    shown = run_sexpgpu("run", "--help", cwd=workdir)
    assert "--steps INTEGER RANGE" in shown.stdout and "x>=1" in shown.stdout
    zero = refused_in_process("run", "examples/my-run.sx", "--steps", "0", cwd=workdir)
    assert zero.returncode == 2
    assert "Invalid value for '--steps': 0 is not in the range x>=1" in zero.stderr
    one = run_sexpgpu(
        "run", "examples/my-run.sx", "--steps", "1", "--metrics-dir", "m", cwd=workdir
    )
    assert one.returncode == 0, one.stderr


def test_docs_run_md_shows_the_fields_a_run_logs(workdir):
    docs = (REPO / "docs" / "run.md").read_text()
    shown = [json.loads(line) for line in docs.splitlines() if line.startswith('{"')]
    assert {r["event"] for r in shown} >= {
        "compiling",
        "run started",
        "step",
        "eval",
        "run finished",
    }
    source = (workdir / "examples" / "tiny-lm.sx").read_text().replace(":every 50", ":every 2")
    (workdir / "probe.sx").write_text(source)
    result = run_sexpgpu(
        "run",
        "probe.sx",
        "--steps",
        "4",
        "--checkpoint-dir",
        "ckpt",
        "--log-every",
        "1",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr
    for doc in shown:
        real = named(result.stderr, doc["event"])
        assert real, doc["event"]
        assert set(real[0]) == set(doc), doc["event"]

"""`sexpgpu runs`: every run of a metrics folder, its state, numbers and times, newest first."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from sexpgpu_report.listing import TAIL_FIRST, process_state, scan_tail
from tests.e2e.helpers import events, run_sexpgpu, sexpgpu_in_process


def _last(run_events: list[dict], name: str) -> float:
    return [e["value"] for e in run_events if e.get("name") == name][-1]


@pytest.mark.slow  # the runs of the gallery: about 25 s on 2 cores
def test_runs_lists_every_state_newest_first(gallery):
    listed = sexpgpu_in_process(
        "runs", "--json", "--metrics-dir", gallery.metrics, cwd=gallery.root
    )
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    by_slug = {row["slug"]: row for row in rows}
    assert set(by_slug) == set(gallery.slugs.values())
    # newest first: the runs were started one after the other in this order
    order = ["interrupted", "gone", "resumed", "failed", "finished"]
    assert [row["slug"] for row in rows] == [gallery.slugs[what] for what in order]

    def row(what: str) -> dict:
        return by_slug[gallery.slugs[what]]

    expected = {
        "finished": ("finished", "-", 40, 40),
        "failed": ("failed", "-", 0, 4),
        "resumed": ("finished", "-", gallery.resumed_steps, gallery.resumed_steps),
        "gone": ("running", "gone", None, 100000),
        "interrupted": ("interrupted", "-", None, 100000),
    }
    for what, (state, process, step, steps) in expected.items():
        got = row(what)
        assert (got["state"], got["process"], got["steps"]) == (state, process, steps), what
        if step is not None:
            assert got["step"] == step, what
        run_events = events(gallery.folder(what))
        assert got["started"] == run_events[0]["time"], what
        assert isinstance(got["updated"], float), what
        assert got["file"].endswith(".sx") and got["run"] in ("small", "my-run"), what
    finished = events(gallery.folder("finished"))
    assert row("finished")["loss"] == _last(finished, "loss")
    assert row("finished")["evals"] == {
        "probe/accuracy": _last(finished, "probe/accuracy"),
        "probe/loss": _last(finished, "probe/loss"),
    }
    assert row("finished")["checkpoint"].endswith("step-00000040")
    assert row("failed")["error"].startswith("step 1: the proposed")
    assert isinstance(row("gone")["step"], int)  # the status file's, written once a second
    # the same run while its process was alive
    assert (gallery.watch["alive"]["state"], gallery.watch["alive"]["process"]) == (
        "running",
        "alive",
    )

    table = sexpgpu_in_process("runs", "--metrics-dir", gallery.metrics, cwd=gallery.root)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[:5] == ["SLUG", "STATE", "STEP", "LOSS", "EVAL"]
    assert [line.split()[0] for line in lines] == [gallery.slugs[what] for what in order]
    assert "running (process gone)" in lines[1] and "failed" in lines[3]
    assert "40/40" in lines[4] and "probe/accuracy=" in lines[4]


def test_runs_of_no_folder_and_of_a_file(tmp_path):
    nothing = run_sexpgpu("runs", "--metrics-dir", "nowhere", cwd=tmp_path)
    assert (nothing.returncode, nothing.stdout) == (0, "no runs under nowhere\n")
    (tmp_path / "a-file").write_text("x")
    bad = run_sexpgpu("runs", "--metrics-dir", "a-file", cwd=tmp_path)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "sexpgpu runs: E-REPORT-001: cannot list the metrics folder a-file: Not a directory"
    ]


def test_tail_reads_further_back_until_a_loss(tmp_path):
    path = tmp_path / "events.jsonl"
    loss = {"kind": "point", "id": "a", "step": 7, "time": 1.0, "name": "loss", "value": 0.5}
    note = {"kind": "annotation", "id": "b", "step": 7, "time": 1.0, "text": "x" * 200}
    evaluated = {**loss, "name": "probe/loss", "value": 0.75}
    later = [json.dumps(note)] * (2 * TAIL_FIRST // 200)  # two first windows of no points
    lines = [json.dumps(loss), json.dumps(evaluated), *later, '{"kind":"poi']  # a torn end
    path.write_text("\n".join(lines))
    assert scan_tail(path) == (0.5, {"probe/loss": 0.75})


def test_process_state_of_a_running_status():
    here = {"host": socket.gethostname(), "started": time.time()}
    assert process_state({**here, "pid": os.getpid()}, host=here["host"]) == "alive"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_state({**here, "pid": child.pid}, host=here["host"]) == "gone"
    # a pid now held by a process that started after the run did: another process
    earlier = {**here, "pid": os.getpid(), "started": time.time() - 10 * 24 * 3600}
    assert process_state(earlier, host=here["host"]) == "gone"
    assert process_state({**here, "pid": os.getpid()}, host="elsewhere") == "unknown"
    assert process_state({"host": here["host"]}, host=here["host"]) == "unknown"


def test_the_default_metrics_folder_is_the_one_runs_report_into():
    from sexpgpu.train import DEFAULT_METRICS_DIR
    from sexpgpu_report.command import report, runs

    for command in (runs, report):
        (option,) = [p for p in command.params if p.name == "metrics_dir"]
        assert (option.default, option.envvar) == (DEFAULT_METRICS_DIR, "SEXPGPU_METRICS_DIR")


def test_tail_names_an_eval_metric_as_the_run_did_escapes_and_all(tmp_path):
    # a name with a quote or a backslash is escaped in the file: the row shows the
    # name, not its JSON spelling (nor skips it)
    path = tmp_path / "events.jsonl"
    point = {"kind": "point", "id": "a", "step": 1, "time": 1.0, "name": "loss", "value": 0.5}
    names = ["<q>/\"quoted\" & 'single'", "back\\slash/loss", "café/loss"]
    lines = [point] + [
        {**point, "id": n, "name": n, "value": float(i)} for i, n in enumerate(names)
    ]
    lines += [{**point, "id": "b", "step": 2, "name": names[0], "value": 9.0}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert scan_tail(path) == (0.5, {names[0]: 9.0, names[1]: 1.0, names[2]: 2.0})

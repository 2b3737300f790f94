"""The run folder is where sexpgpu's own commands find a run, whatever sinks a user
adds, and `sexpgpu evaluate` finds its run's file and metrics or says where they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.foundation.pluginkit import make_plugin, run_sexpgpu
from tests.foundation.test_plugin_checked import CSV, PROGRAM


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run of a small program with only a throwaway CSV sink named, checkpointed."""
    root = tmp_path_factory.mktemp("run-folder")
    site = make_plugin(root / "site", "sexpgpu-csv", {"t_csv": CSV}, {"csv": "t_csv"})
    project = root / "project"
    project.mkdir()
    text = PROGRAM.replace("FORWARD", "(take embed tokens)").replace("OPTIMIZER", "adam")
    (project / "p.sx").write_text(text.replace("METRIC", "accuracy"))
    args = ["run", "p.sx", "--metrics-sink", "csv", "--metrics-dir", "m", "--checkpoint-dir", "ck"]
    done = run_sexpgpu(args, cwd=project, pythonpath=[site])
    assert done.returncode == 0, done.stderr
    return site, project


def _events(folder: Path) -> list[dict]:
    (run,) = folder.iterdir()
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def test_another_sink_keeps_the_run_folder_s_events(trained: tuple[Path, Path]) -> None:
    # before: with `--metrics-sink csv` alone no events.jsonl was written, and `runs`
    # and `report` showed nothing, silently
    site, project = trained
    assert any(e.get("name") == "loss" for e in _events(project / "m"))
    listed = run_sexpgpu(["runs", "--metrics-dir", "m"], cwd=project, pythonpath=[site])
    assert listed.returncode == 0, listed.stderr
    assert "p-" in listed.stdout and "finished" in listed.stdout


def test_a_run_without_the_jsonl_plugin_says_so_at_its_start(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    site, project = trained
    args = ["run", "p.sx", "--metrics-sink", "csv", "--metrics-dir", str(tmp_path / "m")]
    result = run_sexpgpu(args, cwd=project, pythonpath=[site], SEXPGPU_DISABLE_PLUGINS="jsonl")
    assert result.returncode == 0, result.stderr
    warned = [json.loads(line) for line in result.stderr.splitlines() if "events.jsonl" in line]
    assert warned[0]["event"] == (
        "the metrics sink 'jsonl' is unavailable: this run's folder will hold no events.jsonl, "
        "so `sexpgpu runs`, `report` and `evaluate --follow` see none of its numbers, which "
        "go to csv only"
    )
    assert not list((tmp_path / "m").glob("*/events.jsonl"))
    # and the commands that read a run's events say why they show none
    listed = run_sexpgpu(["runs", "--metrics-dir", str(tmp_path / "m")], cwd=project)
    assert listed.returncode == 0, listed.stderr
    (slug,) = [p.name for p in (tmp_path / "m").iterdir()]
    assert listed.stderr == (
        f"no events.jsonl, so no numbers shown, for: {slug} (a run whose metrics went to "
        "other sinks only, or that ended before opening them)\n"
    )


def test_evaluate_from_another_folder_says_how_to_find_the_file_and_the_metrics(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    site, project = trained
    checkpoint = str(project / "ck" / "step-00000004")
    # before: `cannot read p.sx: No such file or directory`, no word of --file
    lost = run_sexpgpu(["evaluate", checkpoint], cwd=tmp_path, pythonpath=[site])
    assert lost.returncode == 2
    assert lost.stderr == (
        f"sexpgpu evaluate: the checkpoint's run compiled p.sx, which is not there from "
        f"{tmp_path} (a relative path is the run's folder's); run evaluate from that folder, "
        "or give the file with --file\n"
    )
    # before: a second ./sexpgpu-runs/<slug> appeared here, without a word
    file = ["--file", str(project / "p.sx")]
    elsewhere = run_sexpgpu(["evaluate", checkpoint, *file], cwd=tmp_path, pythonpath=[site])
    assert elsewhere.returncode == 0, elsewhere.stderr
    (slug,) = [p.name for p in (project / "m").iterdir()]
    assert (
        "sexpgpu evaluate: the run's metrics are not in ./sexpgpu-runs; its numbers go to a new "
        f"./sexpgpu-runs/{slug}: give --metrics-dir the folder the run reported to, to add them "
        "to its own"
    ) in elsewhere.stderr
    # told where they are, its points join the run's own events, without the warning
    own = ["--metrics-dir", str(project / "m")]
    joined = run_sexpgpu(["evaluate", checkpoint, *file, *own], cwd=tmp_path, pythonpath=[site])
    assert joined.returncode == 0, joined.stderr
    assert "are not in" not in joined.stderr
    assert any(e.get("source") == "evaluate" for e in _events(project / "m"))

"""A bundle's sources are its own paths: resuming a bundled run's checkpoint from the
unbundled file (or the reverse) lists each source in the `resumed from` annotation,
by its sha256s when the bundle rewrote it, else by its two paths."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sexpgpu.checkpoint.records import source_place
from sexpgpu.checkpoint.resume import compare_for_resume
from tests.e2e.helpers import EXAMPLES, events, experiments, run_sexpgpu
from tests.lang.lang_helpers import compile_file


def _ok(done) -> None:
    assert done.returncode == 0, done.stderr[-3000:]


def _resumed(tmp_path: Path, source: object, checkpoint: Path, name: str) -> list[str]:
    """The `resumed from` lines of ``source`` resuming a copy of ``checkpoint``."""
    shutil.copytree(checkpoint, tmp_path / name / checkpoint.name)
    _ok(
        run_sexpgpu(
            "run", source, "--checkpoint-dir", name, "--resume", "latest",
            "--metrics-dir", f"m-{name}", cwd=tmp_path,
        )
    )  # fmt: skip
    (run_dir,) = experiments(tmp_path / f"m-{name}")
    (text,) = [e["text"] for e in events(run_dir) if e.get("text", "").startswith("resumed")]
    return text.splitlines()


def test_a_source_the_bundle_did_not_rewrite_is_listed_by_its_two_paths(tmp_path: Path) -> None:
    main = tmp_path / "proj" / "my-run.sx"
    main.parent.mkdir()
    shutil.copy(EXAMPLES / "my-run.sx", main)
    _ok(run_sexpgpu("bundle", main, "-o", "run.sxb", cwd=tmp_path))
    _ok(run_sexpgpu("run", "run.sxb", "--checkpoint-dir", "bundled", cwd=tmp_path))
    _ok(run_sexpgpu("run", main, "--checkpoint-dir", "filed", cwd=tmp_path))
    step = "step-00000002"
    real = os.path.realpath(main)
    assert _resumed(tmp_path, main, tmp_path / "bundled" / step, "from-file") == [
        f"resumed from from-file/{step}",
        f"source my-run.sx sources/my-run.sx -> {real}",
    ]
    assert _resumed(tmp_path, "run.sxb", tmp_path / "filed" / step, "from-bundle") == [
        f"resumed from from-bundle/{step}",
        f"source my-run.sx {real} -> sources/my-run.sx",
    ]


PROGRAM = """\
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (forward (tokens) (take embed tokens)))
(defdata train (arithmetic :digits 3) :seq 8 :batch 2)
(defrun r :model (net 32 4) :data train :loss (mse (model inputs) (model inputs))
  :optimizer (adam :lr 0.1) :steps 2 :seed 1)
"""


def _recorded(program, **paths: str) -> dict:
    """``program``'s ``experiment.json`` with each source's ``path`` as ``paths`` says
    (none for a name not given: a checkpoint older than the field)."""
    sources = []
    for source in program.sources:
        entry = {"name": source.name, "sha256": source.sha256}
        if source.name in paths:
            entry["path"] = paths[source.name]
        sources.append(entry)
    params = [
        {"path": p.path, "shape": list(p.type.shape), "dtype": p.type.dtype,
         "trainable": p.trainable}
        for p in program.params
    ]  # fmt: skip
    states = {p.path: ["m", "v"] for p in program.params}
    return {"sources": sources, "params": params, "states": states, "knobs": []}


def test_which_moves_are_listed(tmp_path: Path) -> None:
    (tmp_path / "run.sx").write_text(PROGRAM)
    program = compile_file(str(tmp_path / "run.sx"))
    real = os.path.realpath(tmp_path / "run.sx")
    states = {"model.embed": ("m", "v")}

    def moved(recorded: dict, bundle: str | None = None) -> list[str]:
        return compare_for_resume(
            recorded, program, devices=1, nodes=1, state_names=states, root=bundle
        )

    assert moved(_recorded(program, **{"run.sx": "sources/run.sx"})) == [
        f"source run.sx sources/run.sx -> {real}"
    ]
    # the same file, the same place, or a project moved between folders: nothing
    assert moved(_recorded(program, **{"run.sx": real})) == []
    assert moved(_recorded(program, **{"run.sx": "/elsewhere/run.sx"})) == []
    # a checkpoint written before sources had paths: nothing to compare
    assert moved(_recorded(program)) == []
    # this run from a bundle unpacked where the file lies: its path in the bundle
    assert source_place(real, str(tmp_path)) == "run.sx"
    assert moved(_recorded(program, **{"run.sx": real}), bundle=str(tmp_path)) == [
        f"source run.sx {real} -> run.sx"
    ]
    # a recorded path cannot forge a line of the annotation
    forged = _recorded(program, **{"run.sx": "a\nknob lr 1 -> 2"})
    assert moved(forged) == [f"source run.sx a\\nknob lr 1 -> 2 -> {real}"]

"""`sexpgpu bundle` and `sexpgpu run NAME.sxb`, as a user runs them.

One project, built by each test in its own folder: a main file that includes a
file from outside its folder, a trainable head and a frozen teacher read with
``:load`` (one inside the folder, one outside), and a text data file.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.e2e.helpers import (
    REPO,
    assert_same_tensors,
    events,
    experiments,
    run_sexpgpu,
    step_dirs,
    tensors,
)
from tests.e2e_storage.buckets import Bucket, gcs_admin_client, s3_admin_client
from tests.e2e_storage.buckets import assert_same_tensors as assert_same_bucket_tensors
from tests.servers import unique_prefix

MAIN = """\
(include "../lib/net.sx")
(defknob steps 4 "training steps")
(defknob lr 0.01)
(defdata train (text :path "corpus.txt") :seq 8 :batch 4)
(defrun bundled
  :model (net 256 8)
  :with-loaded (teacher (tnet 256 8) :file "../weights/teacher.safetensors" :names "{path}.weight")
  :data train
  :loss (+ (cross-entropy (model inputs) targets) (mse (model inputs) (teacher inputs)))
  :optimizer (adam :lr lr)
  :steps steps
  :checkpoint-every 1
  :seed 11)
"""

NET = """\
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02) :load (file "../main/head.safetensors" "lm_head.weight"))
  (forward (tokens) (matmul (take embed tokens) head)))
(deflayer tnet (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))
"""


def _project(root: Path) -> Path:
    """The project under ``root``; returns its main file."""
    rng = np.random.default_rng(3)
    for folder in ("main", "lib", "weights"):
        (root / folder).mkdir(parents=True)
    (root / "main" / "run.sx").write_text(MAIN)
    (root / "lib" / "net.sx").write_text(NET)
    (root / "main" / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    save_file(
        {"lm_head.weight": rng.normal(size=(8, 256)).astype(np.float32)},
        str(root / "main" / "head.safetensors"),
    )
    save_file(
        {
            "teacher.embed.weight": rng.normal(size=(256, 8)).astype(np.float32),
            "teacher.head.weight": rng.normal(size=(8, 256)).astype(np.float32),
        },
        str(root / "weights" / "teacher.safetensors"),
    )
    return root / "main" / "run.sx"


def _ok(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]


def test_a_bundle_replays_the_file_s_run_to_the_bit_without_reading_the_project(tmp_path):
    main = _project(tmp_path / "proj")
    out = tmp_path / "out"
    out.mkdir()
    made = run_sexpgpu("bundle", main, "--with-data", "-o", out / "run.sxb", cwd=tmp_path)
    _ok(made)
    assert "wrote" in made.stdout and "run.sxb" in made.stdout
    with zipfile.ZipFile(out / "run.sxb") as archive:
        kinds = {info.filename: info.compress_type for info in archive.infolist()}
    # sources are deflated; weights and data are stored, inside the folder or outside
    assert kinds["sources/run.sx"] == kinds["outside/1/net.sx"] == zipfile.ZIP_DEFLATED
    assert kinds["sources/head.safetensors"] == zipfile.ZIP_STORED
    assert kinds["outside/2/teacher.safetensors"] == zipfile.ZIP_STORED
    assert kinds["sources/corpus.txt"] == zipfile.ZIP_STORED
    shown = run_sexpgpu("bundle", "--show", out / "run.sxb", cwd=tmp_path)
    _ok(shown)
    for word in ("run.sx", "net.sx", "teacher.safetensors", "head.safetensors", "corpus.txt"):
        assert word in shown.stdout, shown.stdout
    _ok(run_sexpgpu("run", main, "--checkpoint-dir", "ck-file", "--metrics-dir", "m", cwd=tmp_path))
    # the project is gone: the bundle reads nothing of it
    (tmp_path / "proj").rename(tmp_path / "gone")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    replay = run_sexpgpu(
        "run", out / "run.sxb", "--checkpoint-dir", "ck", "--metrics-dir", "m", cwd=elsewhere
    )
    _ok(replay)
    steps = step_dirs(tmp_path / "ck-file")
    assert steps == step_dirs(elsewhere / "ck") and len(steps) == 4
    for step in steps:
        assert_same_tensors(tmp_path / "ck-file" / step, elsewhere / "ck" / step)


def _resume(tmp_path: Path, source: object, checkpoint: Path, name: str) -> Path:
    """``checkpoint`` copied into the folder ``name`` and resumed there with ``source``
    (the file or the bundle) to the end; returns that folder."""
    shutil.copytree(checkpoint, tmp_path / name / checkpoint.name)
    _ok(
        run_sexpgpu(
            "run", source, "--checkpoint-dir", name, "--resume", "latest",
            "--metrics-dir", f"m-{name}", cwd=tmp_path,
        )
    )  # fmt: skip
    return tmp_path / name


def _resumed_lines(tmp_path: Path, name: str) -> list[str]:
    (run_dir,) = experiments(tmp_path / f"m-{name}")
    (text,) = [e["text"] for e in events(run_dir) if e.get("text", "").startswith("resumed")]
    return text.splitlines()


def test_a_bundled_run_s_checkpoints_resume_from_the_file_and_back_to_the_bit(tmp_path):
    main = _project(tmp_path / "proj")
    _ok(run_sexpgpu("bundle", main, "-o", "run.sxb", cwd=tmp_path))
    _ok(run_sexpgpu("run", main, "--checkpoint-dir", "whole", "--metrics-dir", "m", cwd=tmp_path))
    _ok(run_sexpgpu("run", "run.sxb", "--checkpoint-dir", "ck", "--metrics-dir", "m", cwd=tmp_path))
    last = "step-00000004"
    for step in step_dirs(tmp_path / "whole"):
        assert_same_tensors(tmp_path / "whole" / step, tmp_path / "ck" / step)
    # every checkpoint of each, resumed from the other, ends as an uninterrupted run
    for step in step_dirs(tmp_path / "whole")[:-1]:
        from_bundle = _resume(tmp_path, main, tmp_path / "ck" / step, f"file-{step}")
        assert_same_tensors(tmp_path / "whole" / last, from_bundle / last)
        from_file = _resume(tmp_path, "run.sxb", tmp_path / "whole" / step, f"bundle-{step}")
        assert_same_tensors(tmp_path / "whole" / last, from_file / last)

    lines = _resumed_lines(tmp_path, "file-step-00000002")
    # the bundle's sources are its own paths and rewritten files; its load copies too
    assert lines[0] == "resumed from file-step-00000002/step-00000002"
    assert lines[1].startswith("source run.sx ") and not lines[1].endswith(" -")
    assert lines[2].startswith("source ../outside/1/net.sx ") and lines[2].endswith(" -> -")
    assert lines[3].startswith("source ../lib/net.sx - -> ")
    loads = lines[4:]
    assert [line.split()[:2] for line in loads] == [
        ["load", "model.head"], ["load", "teacher.embed"], ["load", "teacher.head"]
    ]  # fmt: skip
    # a bundle's copies are named by their paths in the bundle, wherever it was unpacked
    assert loads[0] == (
        f"load model.head sources/head.safetensors -> "
        f"{tmp_path / 'proj' / 'main' / 'head.safetensors'}"
    ), loads[0]
    assert loads[1].startswith("load teacher.embed outside/2/teacher.safetensors -> ")
    back = _resumed_lines(tmp_path, "bundle-step-00000002")
    assert back[4].startswith("load model.head ") and back[4].endswith(
        " -> sources/head.safetensors"
    ), back
    # a bundle's checkpoint resumed from the bundle again: nothing moved
    _resume(tmp_path, "run.sxb", tmp_path / "ck" / "step-00000002", "again")
    assert _resumed_lines(tmp_path, "again") == ["resumed from again/step-00000002"]


def _rewrite_manifest(bundle: Path, change) -> None:
    with zipfile.ZipFile(bundle) as old:
        items = [(info, old.read(info)) for info in old.infolist()]
    with zipfile.ZipFile(bundle, "w") as new:
        for info, data in items:
            if info.filename == "manifest.json":
                manifest = json.loads(data)
                change(manifest)
                data = json.dumps(manifest).encode()
            new.writestr(info, data)


def test_another_torch_is_one_line_unless_fresh(tmp_path):
    main = _project(tmp_path / "proj")
    _ok(run_sexpgpu("bundle", main, "-o", "run.sxb", cwd=tmp_path))
    _rewrite_manifest(
        tmp_path / "run.sxb", lambda m: m["versions"]["libraries"].update(torch="1.0.0")
    )
    refused = run_sexpgpu("run", "run.sxb", "--steps", "1", cwd=tmp_path)
    assert refused.returncode == 1, refused.stderr
    (line,) = _said(refused.stderr)
    assert line.startswith("sexpgpu run: E-BUNDLE-005: run.sxb was made with other versions")
    assert "torch 1.0.0 ->" in line
    fresh = run_sexpgpu("run", "run.sxb", "--steps", "1", "--choices", "fresh", cwd=tmp_path)
    _ok(fresh)


def test_another_kind_of_machine_is_one_line_unless_fresh(tmp_path):
    main = _project(tmp_path / "proj")
    _ok(run_sexpgpu("bundle", main, "-o", "run.sxb", cwd=tmp_path))

    def made_elsewhere(manifest):  # a processor capability no x86 or ARM machine runs
        manifest["choices"]["cpu.capability"] = "quantum"
        manifest["machine"]["cpu.capability"] = "quantum"

    _rewrite_manifest(tmp_path / "run.sxb", made_elsewhere)
    refused = run_sexpgpu("run", "run.sxb", "--steps", "1", "--checkpoint-dir", "ck", cwd=tmp_path)
    assert refused.returncode == 1, refused.stderr
    (line,) = _said(refused.stderr)
    assert line.startswith(
        "sexpgpu run: E-BUNDLE-008: the bundle was made on another kind of machine: "
        "cpu.capability quantum: torch runs '"
    ), line
    assert not (tmp_path / "ck").exists() or not step_dirs(tmp_path / "ck")
    fresh = run_sexpgpu(
        "run", "run.sxb", "--steps", "1", "--choices", "fresh", "--metrics-dir", "m",
        cwd=tmp_path,
    )  # fmt: skip
    _ok(fresh)
    (run_dir,) = experiments(tmp_path / "m")
    (text,) = [e["text"] for e in events(run_dir) if e.get("text", "").startswith("chose")]
    first, *moved = text.splitlines()
    assert first == "chose afresh, not the bundle's choices"
    assert [line.rsplit(" ", 1)[0] for line in moved] == ["choice cpu.capability quantum ->"]


def test_a_damaged_bundle_is_one_line_and_runs_nothing(tmp_path):
    main = _project(tmp_path / "proj")
    _ok(run_sexpgpu("bundle", main, "--with-data", "-o", "run.sxb", cwd=tmp_path))
    data = bytearray((tmp_path / "run.sxb").read_bytes())
    with zipfile.ZipFile(tmp_path / "run.sxb") as archive:
        info = archive.getinfo("sources/corpus.txt")
    # the member's bytes start after its local header: 30 bytes, its name, its extra
    name, extra = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    data[info.header_offset + 30 + name + extra + 5] ^= 0x01
    (tmp_path / "bad.sxb").write_bytes(bytes(data))
    refused = run_sexpgpu("run", "bad.sxb", "--checkpoint-dir", "ck", cwd=tmp_path)
    assert refused.returncode == 1, refused.stderr
    (line,) = _said(refused.stderr)
    assert line.startswith("sexpgpu run: E-BUNDLE-001: "), line
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "ck").exists()


def _upload(bucket: Bucket, key: str, path: Path) -> None:
    if bucket.scheme == "s3":
        s3_admin_client(bucket.endpoint).put_object(
            Bucket=bucket.name, Key=key, Body=path.read_bytes()
        )
    else:
        gcs_admin_client(bucket.endpoint).bucket(bucket.name).blob(key).upload_from_filename(
            str(path)
        )


@pytest.mark.slow
def test_a_bundle_in_a_bucket_runs_and_checkpoints_there(bucket: Bucket, tmp_path):
    main = _project(tmp_path / "proj")
    _ok(run_sexpgpu("bundle", main, "--with-data", "-o", "run.sxb", cwd=tmp_path))
    _ok(run_sexpgpu("run", main, "--checkpoint-dir", "local", cwd=tmp_path))
    prefix = unique_prefix()
    _upload(bucket, f"{prefix}/run.sxb", tmp_path / "run.sxb")
    env = bucket.env()
    uri, checkpoints = bucket.uri(f"{prefix}/run.sxb"), bucket.uri(f"{prefix}/ck")
    shown = run_sexpgpu("bundle", "--show", uri, cwd=tmp_path, env=env)
    _ok(shown)
    assert "corpus.txt" in shown.stdout and "copied" in shown.stdout
    # the preemptible job's one command: it starts, and would continue, the run
    command = ("run", uri, "--checkpoint-dir", checkpoints, "--resume", "latest")
    _ok(run_sexpgpu(*command, cwd=tmp_path, env=env))
    assert bucket.complete_steps(f"{prefix}/ck")[-1] == "step-00000004"
    assert_same_bucket_tensors(
        bucket.tensors(f"{prefix}/ck/step-00000004"), tensors(tmp_path / "local" / "step-00000004")
    )
    again = run_sexpgpu(*command, cwd=tmp_path, env=env)  # finished: nothing more to do
    _ok(again)
    missing = run_sexpgpu("run", bucket.uri(f"{prefix}/none.sxb"), cwd=tmp_path, env=env)
    assert missing.returncode == 1, missing.stderr
    (line,) = _said(missing.stderr)
    assert line.startswith("sexpgpu run: E-BUNDLE-006: cannot read the bundle "), line
    (tmp_path / "bad.sxb").write_bytes(b"not a zip archive")
    _upload(bucket, f"{prefix}/bad.sxb", tmp_path / "bad.sxb")
    bad = bucket.uri(f"{prefix}/bad.sxb")
    (line,) = _said(run_sexpgpu("run", bad, cwd=tmp_path, env=env).stderr)
    assert line.startswith(f"sexpgpu run: E-BUNDLE-001: {bad} is damaged: "), line


STORE_PROGRAM = """\
(defknob steps 3)
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02) :load (file "{index}" "embed.weight"))
  (param head [dim vocab] :init (normal 0.02) :load (file "{index}" "lm_head.weight"))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 3) :seq 16 :batch 4)
(defrun fromstore :model (net 32 8) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01) :steps steps :checkpoint-every 1 :seed 5)
"""


def test_load_files_in_an_object_store_are_copied_in_and_read_from_the_bundle(
    bucket: Bucket, tmp_path
):
    # an index and its two shards in the bucket: copied in side by side
    rng = np.random.default_rng(5)
    prefix = unique_prefix()
    shards = {
        "shard-1.safetensors": {"embed.weight": rng.normal(size=(32, 8)).astype(np.float32)},
        "shard-2.safetensors": {"lm_head.weight": rng.normal(size=(8, 32)).astype(np.float32)},
    }
    for name, arrays in shards.items():
        save_file(arrays, str(tmp_path / name))
        _upload(bucket, f"{prefix}/model/{name}", tmp_path / name)
    index = {"weight_map": {k: name for name, arrays in shards.items() for k in arrays}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    _upload(bucket, f"{prefix}/model/model.safetensors.index.json", tmp_path / "index.json")
    uri = bucket.uri(f"{prefix}/model/model.safetensors.index.json")
    (tmp_path / "store.sx").write_text(STORE_PROGRAM.replace("{index}", uri))
    env = bucket.env()
    _ok(run_sexpgpu("bundle", "store.sx", "-o", "store.sxb", cwd=tmp_path, env=env))
    _ok(run_sexpgpu("run", "store.sx", "--checkpoint-dir", "file", cwd=tmp_path, env=env))
    with zipfile.ZipFile(tmp_path / "store.sxb") as archive:
        names = set(archive.namelist())
    assert {
        "outside/1/model.safetensors.index.json",
        "outside/1/shard-1.safetensors",
        "outside/1/shard-2.safetensors",
    } <= names, names
    # the bundle runs where the bucket cannot be reached: it reads its copies
    cut_off = bucket.env(endpoint="http://127.0.0.1:9")
    _ok(run_sexpgpu("run", "store.sxb", "--checkpoint-dir", "bundle", cwd=tmp_path, env=cut_off))
    for step in step_dirs(tmp_path / "file"):
        assert_same_tensors(tmp_path / "file" / step, tmp_path / "bundle" / step)


def test_a_bundle_on_two_ranks_holds_the_file_s_bytes_and_resumes_to_them(tmp_path):
    # the data-parallel tests' program, checkpointed every 2 steps
    program = (REPO / "tests" / "distributed" / "dp.sx").read_text()
    assert ":checkpoint-every 20" in program
    (tmp_path / "dp.sx").write_text(program.replace(":checkpoint-every 20", ":checkpoint-every 2"))
    _ok(run_sexpgpu("bundle", "dp.sx", "--steps", "4", "-o", "dp.sxb", cwd=tmp_path))
    two = ("--devices", "2", "--metrics-dir", "m")
    _ok(run_sexpgpu("run", "dp.sx", "--steps", "4", "--checkpoint-dir", "file", *two, cwd=tmp_path))
    _ok(run_sexpgpu("run", "dp.sxb", "--checkpoint-dir", "bundle", *two, cwd=tmp_path))
    for step in ("step-00000002", "step-00000004"):
        assert_same_tensors(tmp_path / "file" / step, tmp_path / "bundle" / step)
    shutil.copytree(tmp_path / "bundle" / "step-00000002", tmp_path / "again" / "step-00000002")
    _ok(
        run_sexpgpu(
            "run", "dp.sxb", "--checkpoint-dir", "again", "--resume", "latest", *two,
            cwd=tmp_path,
        )
    )  # fmt: skip
    assert_same_tensors(tmp_path / "file" / "step-00000004", tmp_path / "again" / "step-00000004")


def test_a_data_file_recorded_not_copied_must_be_the_same_bytes(tmp_path):
    main = _project(tmp_path / "proj")
    _ok(run_sexpgpu("bundle", main, "-o", "run.sxb", cwd=tmp_path))
    corpus = tmp_path / "proj" / "main" / "corpus.txt"
    corpus.write_text(corpus.read_text().replace("fox", "cat"))  # the same size
    refused = run_sexpgpu("run", "run.sxb", "--checkpoint-dir", "ck", cwd=tmp_path)
    assert refused.returncode == 1, refused.stderr
    (line,) = _said(refused.stderr)
    assert line.startswith(f"sexpgpu run: E-BUNDLE-007: run.sxb reads the data file {corpus}")
    assert not (tmp_path / "ck").exists()
    corpus.unlink()
    (line,) = _said(run_sexpgpu("run", "run.sxb", cwd=tmp_path).stderr)
    assert "E-BUNDLE-007" in line and "cannot be read here" in line, line

"""A run checkpoints to s3:// and gs://, resumes from `latest` and from a named step to
the bit, and `sexpgpu checkpoint` describes a checkpoint in a bucket."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, events, experiments, refused_in_process, run_sexpgpu, status
from tests.e2e_storage.buckets import CHECKPOINT_FILES, Bucket, assert_same_tensors, said
from tests.servers import unique_prefix

RUN = ["run", "examples/my-run.sx"]  # 4 steps, a checkpoint every 2

DOCS = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"


@dataclass
class Reference:
    """An uninterrupted run of examples/my-run.sx into a bucket."""

    bucket: Bucket
    prefix: str
    root: Path  # the work folder it ran in

    @property
    def uri(self) -> str:
        return self.bucket.uri(self.prefix)

    def step(self, n: int) -> str:
        return f"{self.prefix}/step-{n:08d}"


@pytest.fixture(scope="module")
def reference(bucket: Bucket, tmp_path_factory) -> Reference:
    root = tmp_path_factory.mktemp(f"reference-{bucket.scheme}")
    shutil.copytree(EXAMPLES, root / "examples")
    prefix = unique_prefix()
    done = run_sexpgpu(
        *RUN,
        "--metrics-dir",
        "m",
        "--checkpoint-dir",
        bucket.uri(prefix),
        cwd=root,
        env=bucket.env(),
    )
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
    return Reference(bucket, prefix, root)


def checkpoint_annotations(run_dir: Path) -> list[dict]:
    return [
        e
        for e in events(run_dir)
        if e.get("kind") == "annotation" and e.get("text", "").startswith("checkpoint ")
    ]


def test_a_run_writes_every_checkpoint_whole_with_its_seconds(reference: Reference):
    bucket = reference.bucket
    objects = bucket.objects(reference.prefix)
    assert sorted(objects) == sorted(
        f"step-{n:08d}/{name}" for n in (2, 4) for name in CHECKPOINT_FILES
    )  # and no probe object left behind
    assert all(size > 0 for size in objects.values())
    (run_dir,) = experiments(reference.root / "m")
    st = status(run_dir)
    assert (st["state"], st["step"], st["checkpoint"]) == (
        "finished",
        4,
        f"{reference.uri}/step-00000004",
    )
    notes = checkpoint_annotations(run_dir)
    assert [(e["step"], e["text"]) for e in notes] == [
        (n, f"checkpoint {reference.uri}/step-{n:08d}") for n in (2, 4)
    ]
    for note in notes:
        # From the first tensor leaving the device to the last byte stored: a real,
        # positive duration, never absent or zero.
        assert isinstance(note["seconds"], float) and note["seconds"] > 0, note
    assert bucket.json(f"{reference.step(4)}/experiment.json")["finished"] is True
    assert bucket.json(f"{reference.step(2)}/experiment.json")["finished"] is False
    assert bucket.json(f"{reference.step(4)}/state.json")["step"] == 4


def test_resume_latest_continues_to_the_bit(reference: Reference, workdir: Path):
    bucket = reference.bucket
    prefix = unique_prefix()
    uri = bucket.uri(prefix)
    args = [*RUN, "--metrics-dir", "m", "--checkpoint-dir", uri, "--resume", "latest"]
    # The same command starts (nothing there yet: a fresh start) and continues.
    first = run_sexpgpu(*args, "--steps", "2", cwd=workdir, env=bucket.env())
    assert first.returncode == 0, first.stderr
    assert bucket.complete_steps(prefix) == ["step-00000002"]
    # The second launch names its location and --resume through the environment.
    env = bucket.env(SEXPGPU_CHECKPOINT_DIR=uri, SEXPGPU_RESUME="latest")
    second = run_sexpgpu(*RUN, "--metrics-dir", "m", cwd=workdir, env=env)
    assert second.returncode == 0, second.stderr

    assert bucket.complete_steps(prefix) == ["step-00000002", "step-00000004"]
    assert_same_tensors(
        bucket.tensors(f"{prefix}/step-00000004"), bucket.tensors(reference.step(4))
    )
    (run_dir,) = experiments(workdir / "m")  # a resumed run is the same experiment
    texts = [e.get("text") for e in events(run_dir)]
    assert f"resumed from {uri}/step-00000002\nknob steps 2 -> 4" in texts
    assert status(run_dir)["state"] == "finished"


def test_resume_from_a_named_step_in_a_bucket(reference: Reference, workdir: Path):
    bucket = reference.bucket
    prefix = unique_prefix()
    done = run_sexpgpu(
        *RUN,
        "--metrics-dir",
        "m",
        "--checkpoint-dir",
        bucket.uri(prefix),
        "--resume",
        f"{reference.uri}/step-00000002",
        cwd=workdir,
        env=bucket.env(),
    )
    assert done.returncode == 0, done.stderr
    assert bucket.complete_steps(prefix) == ["step-00000004"]
    assert_same_tensors(
        bucket.tensors(f"{prefix}/step-00000004"), bucket.tensors(reference.step(4))
    )
    # The named checkpoint is only read: its objects are as they were.
    assert bucket.complete_steps(reference.prefix) == ["step-00000002", "step-00000004"]
    (run_dir,) = experiments(workdir / "m")
    assert f"resumed from {reference.uri}/step-00000002" in [e.get("text") for e in events(run_dir)]


def test_resume_from_a_step_that_is_not_there_is_one_line(reference: Reference, workdir):
    bucket = reference.bucket
    prefix = unique_prefix()
    missing = f"{reference.uri}/step-00000003"
    done = refused_in_process(
        *RUN,
        "--metrics-dir",
        "m",
        "--checkpoint-dir",
        bucket.uri(prefix),
        "--resume",
        missing,
        cwd=workdir,
        env=bucket.env(),
    )
    assert done.returncode == 1
    assert said(done.stderr) == [f"sexpgpu run: E-CKPT-001: there is no checkpoint at {missing}"], (
        done.stderr
    )
    assert bucket.objects(prefix) == {}


def test_sexpgpu_checkpoint_describes_one_in_a_bucket(reference: Reference):
    bucket = reference.bucket
    done = run_sexpgpu(
        "checkpoint", f"{reference.uri}/step-00000004", cwd=reference.root, env=bucket.env()
    )
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert lines[:3] == [
        f"checkpoint {reference.uri}/step-00000004",
        "step       4",
        "sexpgpu    0.1.0",
    ]
    assert "params.safetensors  3 tensors" in lines
    assert re.search(r"^  model\.noise +F32 +\[32\] +frozen", done.stdout, flags=re.M)
    assert re.search(r"^  model\.embed +F32 +\[32, 8\]", done.stdout, flags=re.M)


def test_a_checkpoint_prefix_without_experiment_json_is_not_one(reference: Reference):
    done = run_sexpgpu(
        "checkpoint",
        f"{reference.uri}/step-00000003",
        cwd=reference.root,
        env=reference.bucket.env(),
    )
    assert done.returncode == 1
    (line,) = said(done.stderr)
    assert line.startswith("sexpgpu checkpoint: E-CKPT-001: "), line


def test_the_spec_bucket_snippet_loads_params_a_run_wrote(s3: Bucket, workdir: Path, monkeypatch):
    # The documented snippet names runs/my-run/step-00000004 in "my-bucket": a run writes
    # there (in a fresh bucket, so that only the bucket's name changes in the snippet).
    from tests.e2e_storage.buckets import s3_admin_client
    from tests.servers import new_bucket_name, point_s3_at

    name = new_bucket_name("sx-snippet")
    s3_admin_client(s3.endpoint).create_bucket(Bucket=name)
    mine = Bucket("s3", name, s3.endpoint, s3.home)
    done = run_sexpgpu(
        *RUN,
        "--metrics-dir",
        "m",
        "--checkpoint-dir",
        mine.uri("runs/my-run"),
        cwd=workdir,
        env=mine.env(),
    )
    assert done.returncode == 0, done.stderr

    point_s3_at(monkeypatch, s3.endpoint, workdir)  # boto3.client("s3") finds moto by itself
    snippet = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    (code,) = [s for s in snippet if "boto3" in s]
    scope: dict = {}
    exec(compile(code.replace('"my-bucket"', repr(name)), str(DOCS), "exec"), scope)
    params = scope["params"]
    expected = mine.tensors("runs/my-run/step-00000004")["params.safetensors"]
    assert sorted(params) == sorted(expected) == ["model.embed", "model.head", "model.noise"]
    for key, array in params.items():
        assert (str(array.dtype), array.shape, array.tobytes()) == expected[key]

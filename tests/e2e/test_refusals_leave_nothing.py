"""A run refused before it trains leaves nothing behind, and says why in one line that
never shows a credential (docs/run.md, docs/metrics.md, docs/storage.md):

- no new checkpoint folder and no new metrics folder, whatever refused it: the file, the
  checkpoint to resume, a metrics sink that cannot be opened;
- a sink's errors, opening or writing, have the credentials of any URI in them masked;
- ``--resume latest`` on a location that cannot be reached is refused after one try, not
  after a second round of the same attempts.

The sinks and the unreachable location come from a throwaway plugin, so these runs are
subprocesses; the refusals that need no plugin run in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.catalogs import tiny_program
from tests.foundation.pluginkit import make_plugin, run_sexpgpu

from .helpers import events, experiments, refused_in_process, step_dirs

SECRET = "hunter2"
MASKED = "http://***@collector.example:4318/v1"

TROUBLE_PLUGIN = '''
"""Sinks and a storage that fail as a collector or an endpoint does, naming a URI with
credentials; the storage logs every call it is given in $DEAD_LOG."""

import os

from sexpgpu.errors import StorageError
from sexpgpu.extension import MetricsSinkInfo, StorageBackendInfo
from sexpgpu.hookspecs import hookimpl

URI = "http://someone:hunter2@collector.example:4318/v1"


class Leaky:
    name = "leaky"

    def write(self, events):
        raise ConnectionError(f"cannot reach {URI}: connection refused")

    def close(self):
        pass


def _refused(folder, slug):
    raise OSError(111, "Connection refused", URI)


class Unreachable:
    """A location behind an endpoint nobody answers: every call fails, once logged."""

    def __init__(self, uri):
        self.uri = uri

    def _fail(self, call, *_):
        with open(os.environ["DEAD_LOG"], "a") as log:
            log.write(call + "\\n")
        raise StorageError(f"{call} {self.uri} failed: no answer from the endpoint", code="E-STORAGE-004")

    def describe(self):
        return self.uri

    def check_writable(self):
        self._fail("check_writable")

    def list_children(self, prefix=""):
        self._fail("list_children")

    def exists(self, key):
        self._fail("exists")

    def read(self, key):
        self._fail("read")

    def read_range(self, key, start, length):
        self._fail("read_range")

    def read_range_into(self, key, start, buffer):
        self._fail("read_range_into")

    def write(self, key, data):
        self._fail("write")

    def write_many(self, items, crc32c=None):
        self._fail("write_many")

    def delete(self, key):
        self._fail("delete")

    def remove_temporaries(self, prefix=""):
        self._fail("remove_temporaries")

    def identity(self, key):
        self._fail("identity")


@hookimpl
def sexpgpu_metrics_sinks():
    return [
        MetricsSinkInfo("leaky", lambda folder, slug: Leaky()),
        MetricsSinkInfo("refused", _refused),
    ]


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(schemes=("unreachable",), factory=Unreachable)]
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trouble")
    return make_plugin(
        root, "sexpgpu-trouble", {"sexpgpu_trouble": TROUBLE_PLUGIN}, {"trouble": "sexpgpu_trouble"}
    )


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "tiny.sx").write_text(tiny_program("tiny", checkpoint_every=2))
    return tmp_path


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_refused_run_makes_no_checkpoint_or_metrics_folder(site: Path) -> None:
    (site / "broken.sx").write_text("(defrun")
    refusals = [
        ("broken.sx", "--checkpoint-dir", "new/nested/ck"),
        ("tiny.sx", "--checkpoint-dir", "other", "--resume", "other/step-00000009"),
    ]
    for args in refusals:
        done = refused_in_process("run", *args, "--metrics-dir", "m", cwd=site)
        assert done.returncode != 0, args
        one_line(done.stderr)
        assert sorted(p.name for p in site.iterdir()) == ["broken.sx", "tiny.sx"], args


def test_a_sink_that_cannot_be_opened_refuses_the_run_and_leaves_nothing(
    site: Path, plugin: Path
) -> None:
    run = ["run", "tiny.sx", "--checkpoint-dir", "ck", "--metrics-dir", "m"]
    done = run_sexpgpu([*run, "--metrics-sink", "refused"], cwd=site, pythonpath=[plugin])
    assert done.returncode == 1, done.stderr
    line = one_line(done.stderr)
    assert line.startswith("sexpgpu run: the metrics sink 'refused' cannot be opened: "), line
    assert MASKED in line and SECRET not in done.stderr + done.stdout, line
    assert sorted(p.name for p in site.iterdir()) == ["tiny.sx"]

    # a resume refused so adds no file to the run's folder, and writes no checkpoint
    assert run_sexpgpu(run, cwd=site, pythonpath=[plugin]).returncode == 0
    (run_dir,) = experiments(site / "m")
    (run_dir / "events.jsonl").unlink()
    status = (run_dir / "status.json").read_bytes()
    again = [*run, "--resume", "ck/step-00000002"]
    done = run_sexpgpu([*again, "--metrics-sink", "refused"], cwd=site, pythonpath=[plugin])
    assert done.returncode == 1, done.stderr
    assert SECRET not in done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["status.json"]
    assert (run_dir / "status.json").read_bytes() == status
    assert step_dirs(site / "ck") == ["step-00000002", "step-00000004"]


def test_a_sinks_failing_writes_are_logged_without_credentials(site: Path, plugin: Path) -> None:
    done = run_sexpgpu(
        ["run", "tiny.sx", "--metrics-dir", "m", "--metrics-sink", "leaky"]
        + ["--metrics-wait", "0.2"],
        cwd=site,
        pythonpath=[plugin],
        SEXPGPU_LOG_FORMAT="json",
    )
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    failed = [r for r in logged if r["event"] == "metrics sink write failed; retrying"]
    assert failed, done.stderr
    assert f"ConnectionError: cannot reach {MASKED}: connection refused" == failed[0]["error"]
    (run_dir,) = experiments(site / "m")
    written = (run_dir / "status.json").read_text() + json.dumps(events(run_dir))
    assert SECRET not in done.stderr + done.stdout + written


def test_resume_latest_tries_an_unreachable_location_once(site: Path, plugin: Path) -> None:
    calls = site / "calls.log"
    done = run_sexpgpu(
        ["run", "tiny.sx", "--checkpoint-dir", "unreachable://bucket/run"]
        + ["--resume", "latest", "--metrics-dir", "m"],
        cwd=site,
        pythonpath=[plugin],
        DEAD_LOG=str(calls),
    )
    assert done.returncode == 1, done.stderr
    line = one_line(done.stderr)
    assert line.startswith("sexpgpu run: E-STORAGE-004: "), line
    assert len(calls.read_text().splitlines()) == 1, calls.read_text()
    assert sorted(p.name for p in site.iterdir()) == ["calls.log", "tiny.sx"]

"""One metrics folder of runs in every state, made once for the module by real `sexpgpu`
processes: finished, failed, killed outright (SIGKILL), killed and resumed, and one
stopped by SIGTERM while `sexpgpu report --watch` followed it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, events, experiments, run_sexpgpu, start_sexpgpu

SMALL = Path(__file__).with_name("small.sx")


@dataclass
class Gallery:
    """The folder, each run's slug by what happened to it, and what the watchers did."""

    root: Path
    metrics: Path
    slugs: dict[str, str] = field(default_factory=dict)
    watch: dict[str, object] = field(default_factory=dict)
    resumed_steps: int = 0

    def folder(self, what: str) -> Path:
        return self.metrics / self.slugs[what]

    def save(self, path: Path) -> None:
        data = {**asdict(self), "root": str(self.root), "metrics": str(self.metrics)}
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> Gallery:
        data = json.loads(path.read_text())
        return cls(**{**data, "root": Path(data["root"]), "metrics": Path(data["metrics"])})


def _new_slug(metrics: Path, known: set[str]) -> str:
    (fresh,) = {p.name for p in experiments(metrics)} - known
    known.add(fresh)
    return fresh


def _wait_for_step(
    metrics: Path, known: set[str], step: int, proc: subprocess.Popen, checkpointed: bool = False
) -> None:
    """Wait until a run not in ``known`` has reported a loss at ``step`` or later (and,
    with ``checkpointed``, a stored checkpoint)."""

    def reached(folder: Path) -> bool:
        seen = events(folder)
        return any(e.get("name") == "loss" and e["step"] >= step for e in seen) and (
            not checkpointed or any(e.get("text", "").startswith("checkpoint ") for e in seen)
        )

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(reached(f) for f in experiments(metrics) if f.name not in known):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within 120 s")


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in (content := path.read_text()):
            return content
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} never held {text!r}")


def _watched_run(gallery: Gallery, known: set[str]) -> None:
    """A live run, listed while its process is alive, reported by `report --watch`:
    one watcher stopped by SIGTERM, another that ends by itself when the run is
    stopped by SIGTERM."""
    root, metrics = gallery.root, gallery.metrics
    run = start_sexpgpu(
        "run", SMALL, "--steps", "100000", "--set", "every=5000", "--metrics-dir", metrics,
        "--checkpoint-dir", "ck-live", cwd=root,
    )  # fmt: skip
    procs = [run]
    try:
        _wait_for_step(metrics, known, 3, run)
        slug = gallery.slugs["interrupted"] = _new_slug(metrics, known)
        alive = run_sexpgpu("runs", "--json", "--metrics-dir", metrics, cwd=root)
        gallery.watch["alive"] = {r["slug"]: r for r in json.loads(alive.stdout)}[slug]
        page = metrics / slug / "report" / "index.html"
        args = ("report", slug, "--metrics-dir", metrics, "--watch", "--interval", "0.5")
        first = start_sexpgpu(*args, cwd=root)
        procs.append(first)
        gallery.watch["live_page"] = _wait_for(page, 'http-equiv="refresh"', first)
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
        gallery.watch["signalled"] = (first.returncode, out, err, page.read_text())
        page.unlink()
        second = start_sexpgpu(*args, cwd=root)
        procs.append(second)
        _wait_for(page, 'http-equiv="refresh"', second)
        run.send_signal(signal.SIGTERM)
        run.communicate(timeout=120)
        out, err = second.communicate(timeout=120)
        gallery.watch["ended"] = (second.returncode, out, err, page.read_text())
        gallery.watch["run_rc"] = run.returncode
    finally:
        for proc in procs:  # only after a failure above: each one has ended by now
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="package")
def gallery(tmp_path_factory: pytest.TempPathFactory) -> Gallery:
    """Made once for the whole session, even under pytest-xdist: the first worker to
    need it makes it, the others read what it recorded (the folder is shared)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the folder every worker's own one is in
    record = base / "report-gallery.json"
    with FileLock(str(base / "report-gallery.lock")):
        if record.exists():
            return Gallery.load(record)
        made = _make_gallery(Path(tempfile.mkdtemp(prefix="gallery-", dir=base)))
        made.save(record)
        return made


def _make_gallery(root: Path) -> Gallery:
    shutil.copytree(EXAMPLES, root / "examples")
    gallery = Gallery(root=root, metrics=root / "m")
    known: set[str] = set()
    m = gallery.metrics
    finished = run_sexpgpu("run", SMALL, "--metrics-dir", m, "--checkpoint-dir", "ck-f", cwd=root)
    assert finished.returncode == 0, finished.stderr
    gallery.slugs["finished"] = _new_slug(m, known)
    failed = run_sexpgpu(
        "run", "examples/my-run.sx", "--set", "guard=true", "--set", "lr=1e39",
        "--metrics-dir", m, cwd=root,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    gallery.slugs["failed"] = _new_slug(m, known)
    # killed outright after its checkpoint of step 10, then resumed: steps past 10
    # are reported twice, and the report draws one curve with the resume marked
    killed = start_sexpgpu(
        "run", SMALL, "--steps", "100000", "--metrics-dir", m, "--checkpoint-dir", "ck-r",
        cwd=root,
    )  # fmt: skip
    _wait_for_step(m, known, 13, killed, checkpointed=True)
    killed.kill()
    killed.communicate()
    gallery.slugs["resumed"] = _new_slug(m, known)
    # to the step 15 past the checkpoint it resumes from, wherever the kill came
    last = max(int(p.name.removeprefix("step-")) for p in (root / "ck-r").glob("step-*"))
    gallery.resumed_steps = last + 15
    resumed = run_sexpgpu(
        "run", SMALL, "--steps", gallery.resumed_steps, "--metrics-dir", m,
        "--checkpoint-dir", "ck-r", "--resume", "latest", cwd=root,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    # killed outright and left so: its status file still says running
    gone = start_sexpgpu(
        "run", SMALL, "--steps", "100000", "--metrics-dir", m, "--set", "every=5000", cwd=root
    )  # fmt: skip
    _wait_for_step(m, known, 2, gone)
    gone.kill()
    gone.communicate()
    gallery.slugs["gone"] = _new_slug(m, known)
    _watched_run(gallery, known)
    return gallery

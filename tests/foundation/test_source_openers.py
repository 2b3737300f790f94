"""Files that are not `.sx` files, opened by a plugin's source opener
(``sexpgpu_source_openers``), as a third party writes one: a ``.link`` file names a
`.sx` file and the knobs to run it with. ``sexpgpu run`` and ``sexpgpu.train.run`` take
it alike; an opener's mistake is one line naming it; two openers of one suffix conflict.
The built-in one, bundles (``.sxb``), is tests/bundle's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .pluginkit import make_plugin, run_python, run_sexpgpu

LINK_PLUGIN = '''
"""A source opener: a .link file holds a .sx file's path, then NAME=VALUE knobs."""

import os

from sexpgpu.errors import UsageError
from sexpgpu.extension import OpenedSource, SourceOpenerInfo
from sexpgpu.hookspecs import hookimpl


class LinkOpener:
    def open(self, name, catalog, *, fresh):
        lines = open(name, encoding="utf-8").read().split()
        if not lines:
            raise UsageError(f"{name} names no .sx file")
        if lines[0] == "explode":
            raise ValueError("the link exploded")
        target = os.path.join(os.path.dirname(os.path.abspath(name)), lines[0])
        sets = dict(line.split("=", 1) for line in lines[1:])
        return OpenedSource(named=name, file=target, sets=sets, called="the link's")


@hookimpl
def sexpgpu_source_openers():
    return [SourceOpenerInfo("link", ".link", LinkOpener, doc="a .sx file and its knobs")]
'''

PROGRAM = """
(defknob steps 3)
(defknob lr 0.5)
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 2) :seq 10 :batch 4)
(defrun r :model (net 16 4) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (sgd :lr lr) :steps steps :checkpoint-every 1 :seed 3)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, Path]:
    """A project with a `.sx` file and a link to it, and the link plugin's folder."""
    root = tmp_path_factory.mktemp("links")
    plugins = make_plugin(root / "plugins", "sexpgpu-link", {"sexpgpu_link": LINK_PLUGIN},
                          {"link": "sexpgpu_link"})  # fmt: skip
    project = root / "project"
    project.mkdir()
    (project / "r.sx").write_text(PROGRAM)
    (project / "two.link").write_text("r.sx\nsteps=2\nlr=0.25\n")
    (project / "bad.link").write_text("explode\n")
    (project / "empty.link").write_text("")
    return project, plugins


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_sexpgpu_run_takes_a_file_a_plugin_opens(site) -> None:
    project, plugins = site
    done = run_sexpgpu(["run", "two.link", "--checkpoint-dir", "cli"], cwd=project,
                       pythonpath=[plugins])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _steps(project / "cli") == ["step-00000001", "step-00000002"]  # the link's steps
    experiment = json.loads((project / "cli" / "step-00000002" / "experiment.json").read_text())
    knobs = {k["name"]: (k["value"], k["source"]) for k in experiment["knobs"]}
    assert knobs["lr"] == (0.25, "command line") and knobs["steps"] == (2, "command line")
    # the command line's knobs win over the source's
    again = run_sexpgpu(["run", "two.link", "--steps", "1", "--checkpoint-dir", "one"],
                        cwd=project, pythonpath=[plugins])  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert _steps(project / "one") == ["step-00000001"]
    listed = run_sexpgpu(["plugins", "--json"], cwd=project, pythonpath=[plugins])
    (link,) = [p for p in json.loads(listed.stdout) if p["name"] == "link"]
    assert link["supplies"]["source_openers"][0]["suffix"] == ".link"


def test_sexpgpu_train_run_takes_it_as_the_command_does(site) -> None:
    project, plugins = site
    code = """
from sexpgpu.catalog import Catalog
from sexpgpu.opening import Selection
from sexpgpu.train import RunOptions, run

outcome = run(RunOptions(selection=Selection("two.link"), checkpoint_dir="library"),
              Catalog.load())
raise SystemExit(outcome.exit_code)
"""
    done = run_python(code, cwd=project, pythonpath=[plugins], OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr
    run_sexpgpu(["run", "two.link", "--checkpoint-dir", "by-cli"], cwd=project,
                pythonpath=[plugins])  # fmt: skip
    for step in ("step-00000001", "step-00000002"):
        for file in ("params.safetensors", "states.safetensors"):
            assert (project / "library" / step / file).read_bytes() == (
                project / "by-cli" / step / file
            ).read_bytes()


def test_an_opener_s_refusal_and_its_mistake_are_one_line(site) -> None:
    project, plugins = site
    refused = run_sexpgpu(["run", "empty.link"], cwd=project, pythonpath=[plugins])
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == "sexpgpu run: empty.link names no .sx file"
    broken = run_sexpgpu(["run", "bad.link"], cwd=project, pythonpath=[plugins])
    assert broken.returncode != 0 and "Traceback" not in broken.stderr
    assert (
        "the source opener 'link' failed on bad.link: ValueError: the link exploded"
        in broken.stderr
    )


def test_two_openers_of_one_suffix_conflict(site, tmp_path) -> None:
    project, plugins = site
    other = make_plugin(tmp_path / "other", "sexpgpu-link-too",
                        {"sexpgpu_link_too": LINK_PLUGIN.replace('"link", ".link"', '"links", ".link"')},
                        {"links": "sexpgpu_link_too"})  # fmt: skip
    done = run_sexpgpu(["run", "two.link"], cwd=project, pythonpath=[plugins, other])
    assert done.returncode != 0 and "E-PLUGIN-001" in done.stderr
    assert "source files '*.link'" in done.stderr and "Traceback" not in done.stderr

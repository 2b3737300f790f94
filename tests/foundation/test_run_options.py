"""Plugins add their own `sexpgpu run` options (``sexpgpu_run_options``), as pytest plugins
add theirs: a third party's option shows in `sexpgpu run --help` and reaches its lowering
as a recorded choice request; two plugins' flags conflict; a plugin's flag never
replaces one of the command's own; and the CLI names no torch setting and imports no
torch module (the torch plugin adds --threads and --shard, and launches --devices N)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import click
import pytest

from sexpgpu.catalog import Catalog
from sexpgpu.errors import PluginError
from sexpgpu.extension import RunOptionInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.contracts import broken
from sexpgpu_cli.commands.run import run
from sexpgpu_cli.run_options import own_flags, requested

from .pluginkit import REPO, make_plugin, plugin_line, run_sexpgpu
from .test_architecture import imported_modules, violations

# A lowering of its own (the eager one, recording one more choice) and the option that
# requests that choice: what a third party adds to tune its lowering from the command line.
TUNED = """
from sexpgpu.extension import LoweringInfo, RunOptionInfo
from sexpgpu.hookspecs import hookimpl

LEVEL = "tuned.level"


class Tuned:
    def lower(self, program, *, device, supplies, choices):
        from sexpgpu_torch.lowering import EagerLowering

        trainer = EagerLowering().lower(program, device=device, supplies=supplies, choices=choices)
        trainer.choices[LEVEL] = choices.pin(LEVEL) or "1"  # recorded, as the lowering took it
        return trainer


@hookimpl
def sexpgpu_lowerings():
    return [LoweringInfo("tuned", ("cpu",), Tuned, doc="eager, tuned", default_for=())]


@hookimpl
def sexpgpu_run_options():
    return [RunOptionInfo("--tuned-level", LEVEL, values=("1", "2", "3"),
                          help="How hard the tuned lowering tunes (a test plugin).")]
"""

LEVEL = """
from sexpgpu.extension import RunOptionInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_run_options():
    return [RunOptionInfo("--level", "{name}.level", help="{name}'s level")]
"""

TAKEOVER = """
from sexpgpu.extension import RunOptionInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_run_options():
    return [RunOptionInfo("--device", "my.device", help="the plugin's device")]
"""

CONFLICT = (
    "E-PLUGIN-001: the run option '--level' is supplied by more than one plugin: "
    "'level-a' (level-a 0.1) and 'level-b' (level-b 0.1); "
    "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=level-b"
)


def _install(root: Path, name: str, source: str) -> Path:
    module = name.replace("-", "_")
    return make_plugin(root, name, {module: source}, {name: module})


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "my-run.sx").write_text((REPO / "examples" / "my-run.sx").read_text())
    return tmp_path


def _choices(checkpoint: Path) -> dict[str, str]:
    (experiment,) = sorted(checkpoint.glob("step-*/experiment.json"))[-1:]
    return json.loads(experiment.read_text())["choices"]


def test_a_third_party_option_shows_in_help_and_reaches_the_run(project: Path) -> None:
    site = [_install(project / "site", "tuned", TUNED)]
    help_ = run_sexpgpu(["run", "--help"], cwd=project, pythonpath=site)
    assert help_.returncode == 0, help_.stderr
    shown = " ".join(help_.stdout.split())  # as click wraps it
    assert "--tuned-level [1|2|3] How hard the tuned lowering tunes (a test plugin)." in shown
    assert "--threads INTEGER RANGE The CPU's intra-op thread count" in shown  # torch's
    listing = run_sexpgpu(["plugins"], cwd=project, pythonpath=site).stdout
    assert "run option --tuned-level (requests tuned.level; 1 | 2 | 3)" in listing

    args = ["run", "my-run.sx", "--lowering", "tuned", "--checkpoint-dir", "ck"]
    done = run_sexpgpu([*args, "--tuned-level", "3", "--steps", "2"], cwd=project, pythonpath=site)
    assert done.returncode == 0, done.stderr
    assert _choices(project / "ck")["tuned.level"] == "3"
    # a resume pins it, and asking for another is E-CHOICE-001 in the option's words
    more = [*args, "--resume", "latest", "--steps", "4"]
    refused = run_sexpgpu([*more, "--tuned-level", "2"], cwd=project, pythonpath=site)
    assert refused.returncode == 1
    assert refused.stderr.splitlines()[-1] == (
        "sexpgpu run: E-CHOICE-001: the recorded choice '3' for tuned.level cannot be taken "
        "with --tuned-level 2 (use --choices fresh to choose again)"
    )
    resumed = run_sexpgpu(more, cwd=project, pythonpath=site)
    assert resumed.returncode == 0, resumed.stderr
    assert _choices(project / "ck")["tuned.level"] == "3"
    wrong = run_sexpgpu([*args, "--tuned-level", "9"], cwd=project, pythonpath=site)
    assert (wrong.returncode, wrong.stderr) == (
        2,
        "sexpgpu run: Invalid value for '--tuned-level': '9' is not one of '1', '2', '3'.\n",
    )


def test_two_plugins_adding_one_flag_conflict(project: Path) -> None:
    site = project / "site"
    for name in ("level-a", "level-b"):
        _install(site / name, name, LEVEL.replace("{name}", name))
    paths = [site / "level-a", site / "level-b"]
    refused = run_sexpgpu(["run", "my-run.sx", "--level", "1"], cwd=project, pythonpath=paths)
    assert (refused.returncode, refused.stderr) == (1, f"sexpgpu run: {CONFLICT}\n")
    listing = run_sexpgpu(["plugins"], cwd=project, pythonpath=paths).stdout
    assert plugin_line(listing, "level-a").endswith("  available")
    assert "conflict: its run option '--level' is also supplied by 'level-b' (level-b 0.1)" in (
        listing
    )
    help_ = " ".join(run_sexpgpu(["run", "--help"], cwd=project, pythonpath=paths).stdout.split())
    assert help_.count("--level TEXT") == 1 and f"--level TEXT {CONFLICT}" in help_
    # a run that does not give it runs as before
    ran = run_sexpgpu(["run", "my-run.sx", "--steps", "1"], cwd=project, pythonpath=paths)
    assert ran.returncode == 0, ran.stderr
    # disabling one gives the flag to the other
    settled = run_sexpgpu(
        ["run", "--help"], cwd=project, pythonpath=paths, SEXPGPU_DISABLE_PLUGINS="level-a"
    )
    assert "level-b's level" in settled.stdout and "E-PLUGIN-001" not in settled.stdout


def test_a_plugin_option_never_replaces_a_builtin_one(project: Path) -> None:
    site = [_install(project / "site", "takeover", TAKEOVER)]
    listing = run_sexpgpu(["plugins"], cwd=project, pythonpath=site)
    assert plugin_line(listing.stdout, "takeover").endswith(
        "refused: its run option '--device' would replace the built-in one"
    )
    help_ = " ".join(run_sexpgpu(["run", "--help"], cwd=project, pythonpath=site).stdout.split())
    assert "the plugin's device" not in help_ and "--device TEXT cpu, cuda or cuda:N." in help_


# ---------------------------------------------------------------- in one process


class _Options:
    """A plugin object adding ``options``, unavailable for ``reason`` when given."""

    def __init__(self, *options: RunOptionInfo, reason: str | None = None) -> None:
        self.options, self.reason = list(options), reason

    @hookimpl
    def sexpgpu_run_options(self) -> list[RunOptionInfo]:
        return self.options

    @hookimpl
    def sexpgpu_unavailable(self) -> str | None:
        return self.reason


def _context(catalog: Catalog, *args: str) -> click.Context:
    return run.make_context("run", ["my-run.sx", *args], obj=catalog)


def test_the_options_given_become_the_targets_requests_and_words() -> None:
    catalog = Catalog.of(
        {
            "a": _Options(RunOptionInfo("--speed", "a.speed", minimum=1)),
            "b": _Options(RunOptionInfo("--mode", "b.mode", values=("x", "y"))),
        }
    )
    ctx = _context(catalog, "--speed", "3")
    asked, flags = requested(ctx, ctx.params)
    assert asked == {"a.speed": "3"}
    assert flags == {"a.speed": "--speed", "b.mode": "--mode"}
    with pytest.raises(click.BadParameter):
        _context(catalog, "--speed", "0")
    # made without the CLI's catalog (a test, a tool): the command's own options only
    alone = run.make_context("run", ["my-run.sx"])
    assert requested(alone, alone.params) == ({}, {})


def test_an_option_whose_plugin_is_unavailable_refuses_with_its_reason() -> None:
    option = RunOptionInfo("--speed", "a.speed")
    catalog = Catalog.of({"a": _Options(option, reason="speedlib is not installed: pip it")})
    assert "--speed" in {o for p in run.get_params(_context(catalog)) for o in p.opts}
    with pytest.raises(PluginError) as caught:
        _context(catalog, "--speed", "3")
    assert str(caught.value) == (
        "the run option '--speed' needs the plugin 'a', which is unavailable: "
        "speedlib is not installed: pip it"
    )


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        (RunOptionInfo("-s", "a.speed"), "is no long option"),
        (RunOptionInfo("--Speed", "a.speed"), "is no long option"),
        (RunOptionInfo("--speed", ""), "requests the choice str '', not a name"),
        (RunOptionInfo("--speed", "a", values=("x",), minimum=1), "one or neither"),
        (RunOptionInfo("--speed", "a", values=("x y", "")), "not all of them words"),
    ],
)
def test_a_malformed_option_refuses_its_plugin(option: RunOptionInfo, reason: str) -> None:
    assert reason in (broken("sexpgpu_run_options", option) or "")
    catalog = Catalog.of({"a": _Options(option)})
    catalog.supplied("sexpgpu_run_options")
    record = catalog.record("a")
    assert record is not None and record.refused and reason in (record.reason or "")


def test_the_cli_names_no_torch_setting_and_imports_no_torch_module() -> None:
    assert violations(REPO / "cli", {"torch"}) == []
    late = "def launch():\n    from torch.distributed.launcher.api import elastic_launch\n"
    assert {m for m, _ in imported_modules(late)} >= {"torch.distributed.launcher.api"}
    # the torch plugin supplies what the CLI named: --threads and --shard
    assert {"--threads", "--shard"} & own_flags(run) == set()
    named = set().union(*(_code_strings(p) for p in (REPO / "cli").rglob("*.py")))
    assert named & {"cpu.threads", "--threads", "--shard", "shard"} == set()
    assert "--checkpoint-dir" in named  # the scan sees the command's own


def _code_strings(path: Path) -> set[str]:
    """The string constants of a module's code (not its docstrings)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    }

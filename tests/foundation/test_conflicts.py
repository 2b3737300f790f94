"""No silent takeover: two plugins supplying one thing is a conflict that `sexpgpu
plugins` shows and that refuses the contested thing in one line (E-PLUGIN-001),
while everything not contested keeps working; a plugin command never replaces a
built-in one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from .conflict_plugins import install
from .pluginkit import REPO, make_plugin, plugin_line, run_python, run_sexpgpu

OURS = "sexpgpu's own plugin"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's folder with the examples in it."""
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    return tmp_path


def _sexpgpu(project: Path, *names: str, args: list[str], **env: str):
    site = install(project / "site", *names)
    return run_sexpgpu(args, cwd=project, pythonpath=[site], **env)


def _errors(result) -> str:
    """stderr without the run's JSON log lines (a run logs `compiling` before it fails)."""
    return "".join(line for line in result.stderr.splitlines(True) if not line.startswith("{"))


def _block(listing: str, name: str) -> list[str]:
    """The indented lines under plugin ``name`` in `sexpgpu plugins`."""
    lines = listing.splitlines()
    block = []
    for line in lines[lines.index(plugin_line(listing, name)) + 1 :]:
        if not line.startswith(" "):
            break
        block.append(line.strip())
    return block


def test_plugins_shows_each_conflict(project: Path) -> None:
    result = _sexpgpu(project, "aaa-shadow", args=["plugins"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # both sides are still listed available: only the contested things are refused
    assert plugin_line(out, "aaa-shadow").endswith("  available")
    assert plugin_line(out, "local").endswith("  available")
    shadow = _block(out, "aaa-shadow")
    assert f"conflict: its storage scheme 'file' is also supplied by 'local' ({OURS})" in shadow
    assert f"conflict: its metrics sink 'jsonl' is also supplied by 'jsonl' ({OURS})" in shadow
    assert not any("'shadow'" in line for line in shadow if line.startswith("conflict"))
    assert (
        "conflict: its storage scheme 'file' is also supplied by 'aaa-shadow' (aaa-shadow 0.1)"
        in _block(out, "local")
    )
    section = out.split("\nconflicts (using the contested thing is refused):\n", 1)[1]
    assert (
        "  E-PLUGIN-001: the storage scheme 'file' is supplied by more than one plugin: "
        f"'aaa-shadow' (aaa-shadow 0.1) and 'local' ({OURS}); "
        "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=aaa-shadow"
    ) in section.splitlines()

    records = {
        r["name"]: r for r in json.loads(_sexpgpu(project, args=["plugins", "--json"]).stdout)
    }
    assert records["aaa-shadow"]["conflicts"] == [
        {
            "what": "storage scheme 'file'",
            "hook": "sexpgpu_storage_backends",
            "plugins": ["aaa-shadow", "local"],
        },
        {
            "what": "metrics sink 'jsonl'",
            "hook": "sexpgpu_metrics_sinks",
            "plugins": ["aaa-shadow", "jsonl"],
        },
    ]
    assert records["torch"]["conflicts"] == []


def test_without_a_conflict_plugins_shows_none(project: Path) -> None:
    result = run_sexpgpu(["plugins"], cwd=project)
    assert result.returncode == 0, result.stderr
    assert "conflict" not in result.stdout


def test_a_contested_location_is_refused_and_the_shadow_gets_nothing(project: Path) -> None:
    mark = project / "shadow.mark"
    args = ["run", "examples/my-run.sx", "--checkpoint-dir", "ckpt", "--metrics-dir", "m"]
    result = _sexpgpu(project, "aaa-shadow", args=args, SHADOW_MARK=str(mark))
    assert result.returncode == 1
    assert _errors(result) == (
        "sexpgpu run: E-PLUGIN-001: the location ckpt (file://) is supplied by more than one "
        f"plugin: 'aaa-shadow' (aaa-shadow 0.1) and 'local' ({OURS}); "
        "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=aaa-shadow\n"
    )
    assert not mark.exists() and not (project / "ckpt").exists()

    # the hint works: with the shadow disabled the run trains and checkpoints
    settled = _sexpgpu(
        project, args=args, SHADOW_MARK=str(mark), SEXPGPU_DISABLE_PLUGINS="aaa-shadow"
    )
    assert settled.returncode == 0, settled.stderr
    assert (project / "ckpt" / "step-00000004" / "experiment.json").is_file()
    assert not mark.exists()


def test_a_contested_sink_is_refused(project: Path) -> None:
    mark = project / "shadow.mark"
    args = ["run", "examples/my-run.sx", "--metrics-dir", "m"]
    result = _sexpgpu(project, "aaa-shadow", args=args, SHADOW_MARK=str(mark))
    assert result.returncode == 1
    assert _errors(result) == (
        "sexpgpu run: E-PLUGIN-001: the metrics sink 'jsonl' is supplied by more than one "
        f"plugin: 'aaa-shadow' (aaa-shadow 0.1) and 'jsonl' ({OURS}); "
        "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=aaa-shadow\n"
    )
    assert not mark.exists()


def test_what_is_not_contested_keeps_working(project: Path) -> None:
    mark = project / "shadow.mark"
    site = install(project / "site", "aaa-shadow")
    code = """
        from sexpgpu.catalog import Catalog
        print(Catalog.load().open_location("shadow://x").describe())
    """
    result = run_python(code, cwd=project, pythonpath=[site], SHADOW_MARK=str(mark))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "shadow storage at shadow://x\n"
    assert mark.read_text() == "storage shadow://x\n"


def test_a_contested_kernel_is_refused_only_where_it_is_chosen(project: Path) -> None:
    lm = ["run", "examples/tiny-lm.sx", "--steps", "1", "--metrics-dir", "m"]
    refused = _sexpgpu(project, "twin-kernel", args=lm)
    assert refused.returncode == 1
    assert _errors(refused) == (
        "sexpgpu run: E-PLUGIN-001: the attention kernel 'math' of the torch lowering is "
        f"supplied by more than one plugin: 'torch' ({OURS}) and 'twin-kernel' (twin-kernel 0.1); "
        "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=twin-kernel\n"
    )
    # a program without attention never chooses it, and trains as before
    plain = _sexpgpu(project, args=["run", "examples/my-run.sx", "--metrics-dir", "m"])
    assert plain.returncode == 0, plain.stderr


CONFLICT_IN_FILE = re.compile(
    r"^examples/my-run\.sx:\d+:\d+: E-PLUGIN-001: the (?P<what>.+) is supplied by more than "
    r"one plugin: '(?P<first>[\w-]+)' \((?P<first_at>[^)]+)\) and '(?P<second>[\w-]+)' "
    r"\((?P<second_at>[^)]+)\); disable all but one, e\.g\. SEXPGPU_DISABLE_PLUGINS=(?P<off>\S+)\n$"
)


@pytest.mark.parametrize(
    ("twin", "other", "what", "builtin"),
    [
        ("twin-data", "twin-opt", "data source 'arithmetic'", "data"),
        ("twin-opt", "twin-data", "optimizer 'adam'", "torch"),
    ],
)
def test_a_contested_name_in_a_sx_file_is_refused_at_its_place(
    project: Path, twin: str, other: str, what: str, builtin: str
) -> None:
    result = _sexpgpu(
        project,
        "twin-data",
        "twin-opt",
        args=["check", "examples/my-run.sx"],
        SEXPGPU_DISABLE_PLUGINS=other,
    )
    assert result.returncode == 1
    found = CONFLICT_IN_FILE.match(result.stderr)
    assert found, result.stderr
    assert found["what"] == what
    assert (found["first"], found["first_at"]) == (builtin, OURS)
    assert (found["second"], found["second_at"], found["off"]) == (twin, f"{twin} 0.1", twin)


def test_a_file_naming_nothing_contested_checks(project: Path) -> None:
    # tiny-lm reads `sort` data and uses adamw: neither is contested
    result = _sexpgpu(project, "twin-data", "twin-opt", args=["check", "examples/tiny-lm.sx"])
    assert result.returncode == 0, result.stderr


def test_a_plugin_command_never_replaces_a_builtin_one(project: Path) -> None:
    listing = _sexpgpu(project, "cmd-run", args=["plugins"])
    assert listing.returncode == 0, listing.stderr
    assert plugin_line(listing.stdout, "cmd-run").endswith(
        "refused: its command 'run' would replace the built-in one"
    )
    # what it would add is still shown, so the user sees why
    assert "command run" in _block(listing.stdout, "cmd-run")
    help_ = _sexpgpu(project, args=["run", "--help"])
    assert help_.returncode == 0, help_.stderr
    assert "the plugin's run" not in help_.stdout and "--checkpoint-dir" in help_.stdout
    ran = _sexpgpu(project, args=["run", "examples/my-run.sx", "--metrics-dir", "m"])
    assert ran.returncode == 0, ran.stderr
    assert "the plugin's run" not in ran.stdout
    # the plugin is refused as a whole: its other command is not added
    extra = _sexpgpu(project, args=["cmd-extra"])
    assert extra.returncode == 2 and "No such command 'cmd-extra'" in extra.stderr


def test_a_command_two_plugins_add_is_refused(project: Path) -> None:
    result = _sexpgpu(project, "hello-a", "hello-b", args=["hello"])
    assert result.returncode == 1
    assert result.stderr == (
        "sexpgpu hello: E-PLUGIN-001: the command 'hello' is supplied by more than one plugin: "
        "'hello-a' (hello-a 0.1) and 'hello-b' (hello-b 0.1); "
        "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=hello-b\n"
    )
    assert result.stdout == ""
    # arguments do not get past the refusal either
    with_args = _sexpgpu(project, args=["hello", "--name", "x"])
    assert with_args.returncode == 1 and "E-PLUGIN-001" in with_args.stderr
    # each plugin's own command works
    only = _sexpgpu(project, args=["hello-a-only"])
    assert (only.returncode, only.stdout) == (0, "only a\n")
    listing = _sexpgpu(project, args=["plugins"]).stdout
    assert "conflict: its command 'hello' is also supplied by 'hello-b' (hello-b 0.1)" in _block(
        listing, "hello-a"
    )
    help_ = _sexpgpu(project, args=["--help"]).stdout
    assert "refused: added by hello-a and hello-b" in help_
    # disabling one gives the command to the other
    settled = _sexpgpu(project, args=["hello"], SEXPGPU_DISABLE_PLUGINS="hello-a")
    assert (settled.returncode, settled.stdout) == (0, "hello from b\n")


def test_a_misspelled_hook_is_flagged_with_the_nearest_name(project: Path) -> None:
    result = _sexpgpu(project, "typo", args=["plugins"])
    assert result.returncode == 0, result.stderr
    assert plugin_line(result.stdout, "typo").endswith("  available")
    block = _block(result.stdout, "typo")
    assert block[0] == "hooks: lowerings", "a misspelled hook is not listed as a hook"
    assert (
        "warning: sexpgpu_metric_sinks is not a sexpgpu hook, so it is never called "
        "(did you mean sexpgpu_metrics_sinks?)"
    ) in block
    assert (
        "warning: sexpgpu_storage_backends is not marked with @hookimpl, so it is never called"
    ) in block
    records = {
        r["name"]: r for r in json.loads(_sexpgpu(project, args=["plugins", "--json"]).stdout)
    }
    assert records["typo"]["hooks"] == ["sexpgpu_lowerings"]
    assert len(records["typo"]["warnings"]) == 2
    assert records["torch"]["warnings"] == []


def test_disabling_a_name_that_matches_no_plugin_warns_once(project: Path) -> None:
    result = run_sexpgpu(
        ["--log-format", "json", "check", "examples/my-run.sx"],
        cwd=project,
        SEXPGPU_DISABLE_PLUGINS="tensorbord,local",
    )
    assert result.returncode == 0, result.stderr
    logged = [json.loads(line) for line in result.stderr.splitlines()]
    warnings = [e for e in logged if e["level"] == "warning"]
    assert [e["event"] for e in warnings] == [
        "SEXPGPU_DISABLE_PLUGINS names 'tensorbord', which is no installed plugin "
        "(did you mean 'tensorboard'?)"
    ]
    listing = run_sexpgpu(["plugins"], cwd=project, SEXPGPU_DISABLE_PLUGINS="tensorbord")
    assert listing.stdout.endswith(
        "\nwarnings:\n  SEXPGPU_DISABLE_PLUGINS names 'tensorbord', which is no installed "
        "plugin (did you mean 'tensorboard'?)\n"
    )
    quiet = run_sexpgpu(["check", "examples/my-run.sx"], cwd=project, SEXPGPU_DISABLE_PLUGINS="s3")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


SAME_NAME = """
from sexpgpu.extension import MetricsSinkInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_metrics_sinks():
    return [MetricsSinkInfo("{sink}", lambda folder, slug: None)]
"""


def test_two_distributions_with_one_plugin_name_is_a_warning(project: Path) -> None:
    first, second = project / "first", project / "second"
    make_plugin(first, "dist-one", {"t_one": SAME_NAME.format(sink="one")}, {"same": "t_one"})
    make_plugin(second, "dist-two", {"t_two": SAME_NAME.format(sink="two")}, {"same": "t_two"})
    result = run_sexpgpu(["plugins"], cwd=project, pythonpath=[first, second])
    assert result.returncode == 0, result.stderr
    assert "dist-one 0.1  (t_one)  available" in plugin_line(result.stdout, "same")
    assert "metrics sink one" in _block(result.stdout, "same")
    assert result.stdout.endswith(
        "\nwarnings:\n  the plugin name 'same' is registered by dist-one 0.1 (t_one) and by "
        "dist-two 0.1 (t_two); only the first is loaded\n"
    )
    # a distribution disabled as a whole leaves the name to the other one (so a
    # throwaway test plugin is never hidden by an installed one of the same name)
    isolated = run_sexpgpu(
        ["plugins"],
        cwd=project,
        pythonpath=[first, second],
        SEXPGPU_DISABLE_DISTRIBUTIONS="Dist_One",
    )
    assert "dist-two 0.1  (t_two)  available" in plugin_line(isolated.stdout, "same")
    assert "only the first is loaded" in isolated.stdout


OP_PLUGIN = """
from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import BUILTINS, Arg, OpSpec, same_float

MINE = OpSpec("relu", "a relu of my own", same_float, (Arg("x"),))


@hookimpl
def sexpgpu_ops():
    matmul = BUILTINS.get("matmul")
    return [
        OpInfo("relu", MINE, {"torch": lambda: None}, MINE.doc),
        OpInfo("matmul", matmul, {"{lowering}": lambda: None}, matmul.doc),
    ]
"""


@pytest.mark.parametrize(("lowering", "contested"), [("torch", True), ("other", False)])
def test_ops_named_like_built_ins_and_second_implementations(
    tmp_path: Path, lowering: str, contested: bool
) -> None:
    # A new op named like a built-in would never be called: a conflict with the core.
    # A second implementation of a built-in op conflicts only for the same lowering.
    site = make_plugin(
        tmp_path / "site",
        "sexpgpu-my-ops",
        {"sexpgpu_my_ops": OP_PLUGIN.replace("{lowering}", lowering)},
        {"my-ops": "sexpgpu_my_ops"},
    )
    result = run_sexpgpu(["plugins"], cwd=tmp_path, pythonpath=[site])
    assert result.returncode == 0, result.stderr
    mine = _block(result.stdout, "my-ops")
    assert "conflict: its op 'relu' is also supplied by sexpgpu's built-in ops" in mine
    implementation = (
        f"conflict: its torch implementation of op 'matmul' is also supplied by 'torch' ({OURS})"
    )
    assert (implementation in mine) is contested
    assert (
        "conflict: its torch implementation of op 'matmul' is also supplied by 'my-ops' "
        "(sexpgpu-my-ops 0.1)" in _block(result.stdout, "torch")
    ) is contested

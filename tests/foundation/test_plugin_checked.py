"""A plugin is checked when the program is: a clash is refused where the program uses
the contested thing (not at the first eval pass, hours in), a plugin's contracts are
held before step 1, and each error names the plugin and the user's call site.

Each test installs throwaway plugins (tests/foundation/pluginkit.py) and runs
`sexpgpu` as a user does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.foundation.pluginkit import make_plugin, plugin_line, run_sexpgpu

CLASH = '''
"""An eval metric and an op named like sexpgpu's own."""

from sexpgpu.extension import EvalMetricInfo, OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec, same_float

MINE = OpSpec("relu", "a relu of my own", same_float, (Arg("x"),))


@hookimpl
def sexpgpu_eval_metrics():
    return [EvalMetricInfo("perplexity", "loss")]


@hookimpl
def sexpgpu_ops():
    return [OpInfo("relu", MINE, {"torch": lambda: (lambda attrs: (lambda x: x))}, MINE.doc)]
'''

COMMAND = '''
"""A `report` command of its own."""

import click

from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_cli_commands(cli):
    @click.command("report")
    def report():
        """A report of my own."""
        click.echo("the clash plugin's report")

    cli.add_command(report)
'''

BROKEN = '''
"""Plugins that break their contracts, each in a way only a program shows."""

import os

import torch

from sexpgpu.extension import EvalMetricInfo, OpInfo, OptimizerInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec, same_float

NARROW = OpSpec("narrow-first", "declares its input's type, gives one column", same_float, (Arg("x"),))


class MisnamedStates:
    """init_states keys its states 'mom'; state_names declares 'm'."""

    def init_states(self, params, options):
        return {"mom": [torch.zeros_like(p) for p in params]}

    def propose(self, params, grads, states, *, lr, count, options, decay):
        return [p - lr * g for p, g in zip(params, grads)], {"m": list(states["m"])}


def finish(mean):
    if os.environ.get("FINISH_FAILS"):
        raise ValueError("the finisher broke")
    return mean


@hookimpl
def sexpgpu_optimizers():
    return [OptimizerInfo("misnamed", {"lr": 0.1}, lambda options: ("m",), MisnamedStates)]


@hookimpl
def sexpgpu_ops():
    build = lambda attrs: (lambda x: x[..., :1])  # noqa: E731
    return [OpInfo("narrow-first", NARROW, {"torch": lambda: build})]


@hookimpl
def sexpgpu_eval_metrics():
    return [
        EvalMetricInfo("mean-abs-error", "(mean (abs (- logits targets)))"),
        EvalMetricInfo("fragile", "loss", finish=finish),
    ]
'''

UNPARSED = """
from sexpgpu.extension import EvalMetricInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_eval_metrics():
    return [EvalMetricInfo("half-open", "(mean (abs logits)")]
"""

CSV = """
from sexpgpu.extension import MetricsSinkInfo
from sexpgpu.hookspecs import hookimpl


class CsvSink:
    def __init__(self, metrics_dir, slug):
        pass

    def write(self, events):
        pass

    def close(self):
        pass


@hookimpl
def sexpgpu_metrics_sinks():
    return [MetricsSinkInfo("csv", CsvSink)]
"""

PROGRAM = """
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul FORWARD head)))
(defdata train (arithmetic :digits 3) :seq 16 :batch 4)
(defrun r
  :model (net 32 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (OPTIMIZER :lr 0.001)
  :steps 4
  :checkpoint-every 2
  :seed 1
  :evals ((eval probe :every 2 :data train :batches 1 :metrics (loss METRIC))))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    make_plugin(root, "sexpgpu-clash", {"t_clash": CLASH}, {"clash": "t_clash"})
    make_plugin(root, "sexpgpu-broken", {"t_broken": BROKEN}, {"broken": "t_broken"})
    make_plugin(root, "sexpgpu-unparsed", {"t_unparsed": UNPARSED}, {"unparsed": "t_unparsed"})
    make_plugin(root, "sexpgpu-csv", {"t_csv": CSV}, {"csv": "t_csv"})
    make_plugin(root, "sexpgpu-command", {"t_command": COMMAND}, {"command": "t_command"})
    return root


def _program(
    folder: Path,
    *,
    forward: str = "(take embed tokens)",
    optimizer: str = "adam",
    metric: str = "accuracy",
) -> str:
    text = PROGRAM.replace("FORWARD", forward).replace("OPTIMIZER", optimizer)
    (folder / "p.sx").write_text(text.replace("METRIC", metric))
    return "p.sx"


def _at(name: str, text: str) -> str:
    """``p.sx:line:col`` of the first ``name`` in the program ``text``."""
    for number, line in enumerate(text.splitlines(), start=1):
        if name in line:
            return f"p.sx:{number}:{line.index(name) + 1}"
    raise AssertionError(name)


def _sexpgpu(site: Path, folder: Path, *args: str, disable: str = "", **env: str):
    ours = ("broken", "clash", "command", "csv", "unparsed")
    off = ",".join(name for name in ours if name not in disable.split("+"))
    # every throwaway plugin but the ones a test names stays out of its way
    return run_sexpgpu(
        list(args), cwd=folder, pythonpath=[site], SEXPGPU_DISABLE_PLUGINS=off, **env
    )


def _last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_an_eval_metric_clash_is_refused_at_check_where_the_file_names_it(
    site: Path, tmp_path: Path
) -> None:
    # before: `check` passed and the run died at its first pass, its steps lost
    file = _program(tmp_path, metric="perplexity")
    result = _sexpgpu(site, tmp_path, "check", file, disable="clash")
    assert result.returncode == 1
    at = _at("perplexity", (tmp_path / file).read_text())
    assert result.stderr == (
        f"{at}: E-PLUGIN-001: the eval metric 'perplexity' is supplied by more than one plugin: "
        "'clash' (sexpgpu-clash 0.1) and 'eval' (sexpgpu's own plugin); disable all but one, "
        "e.g. SEXPGPU_DISABLE_PLUGINS=clash\n"
    )


def test_an_op_named_like_a_built_in_is_refused_where_the_file_calls_it(
    site: Path, tmp_path: Path
) -> None:
    # before: the built-in relu was used silently, though `plugins` listed a conflict
    file = _program(tmp_path, forward="(relu (take embed tokens))")
    result = _sexpgpu(site, tmp_path, "check", file, disable="clash")
    assert result.returncode == 1
    at = _at("relu", (tmp_path / file).read_text())
    assert result.stderr.startswith(
        f"{at}: E-PLUGIN-001: the op 'relu' is supplied by more than one plugin: "
        "sexpgpu's built-in ops and 'clash' (sexpgpu-clash 0.1)"
    ), result.stderr
    # a program that names neither contested thing is not refused
    plain = _sexpgpu(site, tmp_path, "check", _program(tmp_path), disable="clash")
    assert plain.returncode == 0, plain.stderr


def test_sexpgpu_s_own_commands_are_protected_from_a_plugin(site: Path, tmp_path: Path) -> None:
    # before: a plugin's `report` disabled the built-in one ("refused: added by ...")
    listed = _sexpgpu(site, tmp_path, "plugins", disable="command")
    assert plugin_line(listed.stdout, "command").endswith(
        "refused: its command 'report' would replace the built-in one"
    )
    helped = _sexpgpu(site, tmp_path, "report", "--help", disable="command")
    assert helped.returncode == 0, helped.stderr
    assert "A report of my own" not in helped.stdout
    assert "Usage: sexpgpu report [OPTIONS] RUN" in helped.stdout


def test_an_optimizer_s_states_are_held_to_its_state_names_before_step_1(
    site: Path, tmp_path: Path
) -> None:
    # before: `step 1: KeyError: 'm'`, naming neither the optimizer nor its plugin
    file = _program(tmp_path, optimizer="misnamed")
    result = _sexpgpu(site, tmp_path, "run", file, "--metrics-dir", "m", disable="broken")
    assert result.returncode == 1
    at = _at("(misnamed", (tmp_path / file).read_text())
    assert _last_line(result) == (
        f"sexpgpu run: {at}: the optimizer 'misnamed' of the plugin 'broken': its init_states "
        "made the states ['mom'], where its state_names declares ['m']"
    )
    assert '"event": "step"' not in result.stderr  # refused when lowered, no step taken


@pytest.mark.parametrize("lowering", ["torch", "compiled"])
def test_an_op_s_output_is_held_to_its_spec_when_lowered(
    site: Path, tmp_path: Path, lowering: str
) -> None:
    # before: `step 1: RuntimeError: mat1 and mat2 shapes cannot be multiplied`
    file = _program(tmp_path, forward="(narrow-first (take embed tokens))")
    args = ["run", file, "--metrics-dir", "m", "--lowering", lowering]
    result = _sexpgpu(site, tmp_path, *args, disable="broken")
    assert result.returncode == 1
    at = _at("(narrow-first", (tmp_path / file).read_text())
    assert _last_line(result) == (
        f"sexpgpu run: {at}: the op 'narrow-first' of the plugin 'broken' gives f32[4, 16, 1] "
        "for (f32[4, 16, 8]), where its spec declares f32[4, 16, 8]; the plugin's "
        "implementation and its infer disagree"
    )
    assert '"event": "step"' not in result.stderr


def test_a_metric_that_does_not_fit_is_told_at_the_user_s_evals(site: Path, tmp_path: Path) -> None:
    # before: the error pointed at `<metric mean-abs-error>:1:12`, not the user's file
    file = _program(tmp_path, metric="mean-abs-error")
    result = _sexpgpu(site, tmp_path, "check", file, disable="broken")
    assert result.returncode == 1
    at = _at("mean-abs-error", (tmp_path / file).read_text())
    assert result.stderr.startswith(
        f"{at}: the eval metric 'mean-abs-error' of the plugin 'broken' does not fit the pass "
        "'probe': <metric mean-abs-error>:1:12: sub: shapes f32[4, 16, 32] and i64[4, 16]"
    ), result.stderr


def test_a_metric_whose_text_does_not_parse_makes_its_plugin_refused(
    site: Path, tmp_path: Path
) -> None:
    # before: listed "available", and refused only when a program used it
    reason = (
        "its eval metric 'half-open' does not parse: <metric half-open>:1:1: '(' is never closed"
    )
    listed = _sexpgpu(site, tmp_path, "plugins", "--json", disable="unparsed")
    (entry,) = [p for p in json.loads(listed.stdout) if p["name"] == "unparsed"]
    assert (entry["available"], entry["refused"], entry["reason"]) == (False, True, reason)
    file = _program(tmp_path, metric="half-open")
    result = _sexpgpu(site, tmp_path, "check", file, disable="unparsed")
    at = _at("half-open", (tmp_path / file).read_text())
    assert result.stderr == (
        f"{at}: the eval metric 'half-open' needs the plugin 'unparsed', which is refused: "
        f"{reason}\n"
    )


def test_names_are_refused_with_the_nearest_and_the_disabled_plugins(
    site: Path, tmp_path: Path
) -> None:
    file = _program(tmp_path)
    sink = _sexpgpu(site, tmp_path, "run", file, "--metrics-sink", "cvs", disable="csv")
    assert _last_line(sink).startswith(
        "sexpgpu run: unknown metrics sink 'cvs' (did you mean 'csv'?); "
        "metrics sinks: csv, jsonl, mlflow, tensorboard; "
    )
    # an optimizer whose plugin is disabled is named as an op's is
    misnamed = _program(tmp_path, optimizer="misnamed")
    result = _sexpgpu(site, tmp_path, "check", misnamed)
    at = _at("misnamed", (tmp_path / misnamed).read_text())
    assert result.stderr.startswith(f"{at}: unknown optimizer 'misnamed'; optimizers: adam, ")
    assert result.stderr.rstrip().endswith(
        "it may come from a plugin disabled by SEXPGPU_DISABLE_PLUGINS: "
        "broken, clash, command, csv, unparsed"
    )


def test_a_failing_pass_keeps_its_committed_step_and_names_the_pass(
    site: Path, tmp_path: Path
) -> None:
    # before: `step 3: ...` (the pass followed step 2) and `"checkpoint": null`
    file = _program(tmp_path, metric="fragile")
    args = ["run", file, "--metrics-dir", "m", "--checkpoint-dir", "ck", "--resume", "latest"]
    failed = _sexpgpu(site, tmp_path, *args, disable="broken", FINISH_FAILS="1")
    assert failed.returncode == 1
    assert _last_line(failed).startswith(
        "sexpgpu run: the pass 'probe' after step 2: ValueError: the finisher broke"
    )
    state = json.loads((tmp_path / "ck" / "step-00000002" / "state.json").read_text())
    assert state["evals_pending"] == ["probe"]
    # fixed, the resume runs the pass it owes and goes on
    resumed = _sexpgpu(site, tmp_path, *args, disable="broken")
    assert resumed.returncode == 0, resumed.stderr
    assert '"event": "run resumed"' in resumed.stderr
    # to the bit of a run whose pass never failed
    whole = tmp_path / "whole"
    whole.mkdir()
    _program(whole, metric="fragile")
    never = _sexpgpu(site, whole, *args, disable="broken")
    assert never.returncode == 0, never.stderr
    for name in ("params.safetensors", "states.safetensors"):
        at = Path("ck", "step-00000004", name)
        assert (tmp_path / at).read_bytes() == (whole / at).read_bytes(), name

"""A third party's mistake in what its plugin declares is named, in one line and without
a traceback, and locks nobody out (issue 51, cases 8 to 10): a plugin is refused when
it is loaded for a hook that answers with another type than it declares, or for names
and defaults a `.sx` file cannot write; a plugin op whose ``infer`` raises is told at
the call, naming the plugin (``E-PLUGIN-002``). Everything else keeps working.

The plugins are throwaway distributions (tests/foundation/pluginkit.py) put on this
process's ``sys.path``, so ``sexpgpu plugins`` and ``check`` run in-process
(tests/inprocess.py), and a ``run`` refused before lowering too; a run that trains
is a subprocess, with the plugins on its ``PYTHONPATH``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest

import sexpgpu_data
import sexpgpu_eval
import sexpgpu_jsonl
import sexpgpu_torch
from sexpgpu import lang
from sexpgpu.catalog import Catalog
from sexpgpu.errors import PluginError
from sexpgpu.extension import (
    DataSourceInfo,
    MetricsSinkInfo,
    OpInfo,
    OptimizerInfo,
    StorageBackendInfo,
)
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, Keyword, OpSpec, same_float
from sexpgpu.plugin_supplies import SUPPLIES
from tests import inprocess
from tests.foundation.pluginkit import make_plugin, plugin_line, run_sexpgpu
from tests.lang import test_generate as generating

TAG = uuid.uuid4().hex[:8]  # module names of this run's plugins, never another test's

ODD_OPTIONS = """
from sexpgpu.extension import OptimizerInfo
from sexpgpu.hookspecs import hookimpl


class Update:
    def init_states(self, params, options):
        return {}

    def propose(self, params, grads, states, *, lr, count, options, decay):
        return [p - lr * g for p, g in zip(params, grads)], {}


@hookimpl
def sexpgpu_optimizers():
    options = {"lr": 0.1, "": 1.0, "a/b": 2.0, "bad option!": 3.0, "lr ": 4.0}
    return [OptimizerInfo("oddopt", options, lambda options: (), Update)]
"""

EXPLODING = """
from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec


def explode(op, args, attrs, pos):
    raise KeyError("infer exploded")


def shapeless(op, args, attrs, pos):
    return (4, 8)  # a shape, where a TensorType is due


def implementation():
    return lambda attrs: (lambda x: x)


@hookimpl
def sexpgpu_ops():
    return [
        OpInfo("explode", OpSpec("explode", "raises in infer", explode, (Arg("x"),)),
               {"torch": implementation}),
        OpInfo("shapeless", OpSpec("shapeless", "types nothing", shapeless, (Arg("x"),)),
               {"torch": implementation}),
    ]
"""

ONE_SINK = """
from sexpgpu.extension import MetricsSinkInfo
from sexpgpu.hookspecs import hookimpl


class CsvSink:
    def __init__(self, folder, slug):
        pass

    def write(self, events):
        pass

    def close(self):
        pass


@hookimpl
def sexpgpu_metrics_sinks():
    return MetricsSinkInfo("csv", CsvSink)  # one descriptor, not a list of them
"""

PLUGINS = {"oddopt": ODD_OPTIONS, "explode": EXPLODING, "onesink": ONE_SINK}

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
  :steps 2
  :seed 1)
"""

REFUSED_OPTIONS = (
    "its optimizer 'oddopt' declares options no .sx file can write: '', 'a/b', "
    "'bad option!', 'lr ' (a name is a letter, then letters, digits, '-' or '_')"
)
REFUSED_SINK = (
    "its sexpgpu_metrics_sinks returned one MetricsSinkInfo, not a list of MetricsSinkInfo"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    for name, code in PLUGINS.items():
        make_plugin(root, name, {f"t_{name}_{TAG}": code}, {name: f"t_{name}_{TAG}"})
    return root


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch):
    """The three plugins installed in this process, as pip would leave them."""
    monkeypatch.delenv("SEXPGPU_DISABLE_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in PLUGINS:
        sys.modules.pop(f"t_{name}_{TAG}", None)


def _program(folder: Path, *, forward: str = "(take embed tokens)", optimizer: str = "adam"):
    (folder / "p.sx").write_text(
        PROGRAM.replace("FORWARD", forward).replace("OPTIMIZER", optimizer)
    )
    return "p.sx"


def _at(name: str, folder: Path) -> str:
    """``p.sx:line:col`` of the first ``name`` in the program."""
    for number, line in enumerate((folder / "p.sx").read_text().splitlines(), start=1):
        if name in line:
            return f"p.sx:{number}:{line.index(name) + 1}"
    raise AssertionError(name)


def _last_line(result: Any) -> str:
    """The last line of a command's stderr (a run logs before it is refused)."""
    return result.stderr.splitlines(keepends=True)[-1]


def test_plugins_lists_the_refused_plugins_with_their_reasons(installed: Path) -> None:
    listed = inprocess.sexpgpu("plugins")
    assert (listed.returncode, listed.stderr) == (0, "")
    assert plugin_line(listed.stdout, "oddopt").endswith(f"  refused: {REFUSED_OPTIONS}")
    assert plugin_line(listed.stdout, "onesink").endswith(f"  refused: {REFUSED_SINK}")
    # what a refused plugin would supply is still shown, so the user sees what is lost
    assert "metrics sink csv" in listed.stdout
    # an op whose infer raises cannot be told before a program calls it
    assert plugin_line(listed.stdout, "explode").endswith("  available")
    assert plugin_line(listed.stdout, "jsonl").endswith("  available")
    records = {r["name"]: r for r in json.loads(inprocess.sexpgpu("plugins", "--json").stdout)}
    for name, reason in (("oddopt", REFUSED_OPTIONS), ("onesink", REFUSED_SINK)):
        assert (records[name]["available"], records[name]["refused"]) == (False, True)
        assert records[name]["reason"] == reason
    assert (records["explode"]["available"], records["explode"]["refused"]) == (True, False)


def test_case_8_unwritable_option_names_refuse_the_optimizer_where_it_is_used(
    installed: Path, tmp_path: Path
) -> None:
    # before: listed available, and `check` and `run` of a file using it exited 0
    file = _program(tmp_path, optimizer="oddopt")
    line = (
        f"{_at('oddopt', tmp_path)}: the optimizer 'oddopt' needs the plugin 'oddopt', "
        f"which is refused: {REFUSED_OPTIONS}\n"
    )
    checked = inprocess.sexpgpu("check", file, cwd=tmp_path)
    assert (checked.returncode, checked.stderr) == (1, line)
    ran = inprocess.refused("run", file, "--metrics-dir", "m", cwd=tmp_path)
    assert (ran.returncode, _last_line(ran)) == (1, line)
    assert "Traceback" not in ran.stderr and not (tmp_path / "m").exists()
    # a file that names another optimizer is checked as ever
    plain = inprocess.sexpgpu("check", _program(tmp_path), cwd=tmp_path)
    assert (plain.returncode, plain.stderr) == (0, "")


@pytest.mark.parametrize(
    ("op", "told"),
    [
        ("explode", "its infer raised KeyError: 'infer exploded'"),
        ("shapeless", "its infer returned (4, 8), not a TensorType"),
    ],
)
def test_case_9_an_op_whose_infer_fails_is_one_line_naming_plugin_op_and_call(
    installed: Path, tmp_path: Path, op: str, told: str
) -> None:
    # before: `KeyError: 'infer exploded'`, a traceback naming neither plugin nor place
    file = _program(tmp_path, forward=f"({op} (take embed tokens))")
    line = f"{_at('(' + op, tmp_path)}: E-PLUGIN-002: the op '{op}' of the plugin 'explode': {told}"
    checked = inprocess.sexpgpu("check", file, cwd=tmp_path)
    assert (checked.returncode, checked.stderr) == (1, f"sexpgpu check: {line}\n")
    ran = inprocess.refused("run", file, "--metrics-dir", "m", cwd=tmp_path)
    assert (ran.returncode, _last_line(ran)) == (1, f"sexpgpu run: {line}\n")
    assert "Traceback" not in ran.stderr and not (tmp_path / "m").exists()


def test_case_10_a_hook_of_the_wrong_type_locks_nobody_out(installed: Path, tmp_path: Path) -> None:
    # before: `sexpgpu plugins` and every run ended in
    # TypeError: 'MetricsSinkInfo' object is not iterable (catalog.py)
    file = _program(tmp_path)
    helped = inprocess.sexpgpu("--help")
    assert helped.returncode == 0 and "plugins" in helped.stdout, helped.stderr
    ran = run_sexpgpu(["run", file, "--metrics-dir", "m"], cwd=tmp_path, pythonpath=[installed])
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr and '"event": "run finished"' in ran.stderr
    asked = run_sexpgpu(
        ["run", file, "--metrics-dir", "n", "--metrics-sink", "csv"],
        cwd=tmp_path,
        pythonpath=[installed],
    )
    assert asked.returncode == 1
    assert asked.stderr.strip().splitlines()[-1] == (
        f"sexpgpu run: the metrics sink 'csv' needs the plugin 'onesink', which is refused: "
        f"{REFUSED_SINK}"
    )
    assert "Traceback" not in asked.stderr


# ---------------------------------------------------------------- every hook, every contract
# In-process catalogs of objects in hand: sexpgpu's own plugins beside one of ours.

OURS = {"torch": sexpgpu_torch, "data": sexpgpu_data, "jsonl": sexpgpu_jsonl}


def _hooked(hook: str, answer: Any) -> object:
    """A plugin whose ``hook`` answers ``answer``."""

    def implementation(self: object) -> Any:
        return answer

    implementation.__name__ = hook  # what pluggy and the catalog know a hook by
    return type("Answering", (), {hook: hookimpl(implementation)})()


def _refusal(hook: str, answer: Any) -> str | None:
    """The reason the plugin answering ``answer`` to ``hook`` is refused (``None``: it is
    not), once the catalog has asked it; sexpgpu's own plugins are never affected."""
    catalog = Catalog.of({**OURS, "mine": _hooked(hook, answer)})
    if hook == "sexpgpu_cli_commands":
        catalog.ask(catalog.record("mine"), hook, cli=click.Group())
    elif hook != "sexpgpu_unavailable":  # asked as the plugin is registered
        catalog.supplied(hook)
    assert [r.name for r in catalog.records if not r.available] in ([], ["mine"])
    mine = catalog.record("mine")
    assert mine.hooks == [hook] and mine.refused == (not mine.available), mine
    return mine.reason


def _sink(name: str = "csv") -> MetricsSinkInfo:
    return MetricsSinkInfo(name, lambda folder, slug: None)


def _optimizer(options: dict, name: str = "opt") -> OptimizerInfo:
    return OptimizerInfo(name, options, lambda options: (), object)


HOOK_ANSWERS = [
    ("sexpgpu_metrics_sinks", [_sink()], None),
    ("sexpgpu_metrics_sinks", [], None),
    (
        "sexpgpu_metrics_sinks",
        _sink(),
        "its sexpgpu_metrics_sinks returned one MetricsSinkInfo, not a list of MetricsSinkInfo",
    ),
    (
        "sexpgpu_metrics_sinks",
        [_sink(), "csv", {"name": "x"}],
        "its sexpgpu_metrics_sinks returned a list holding str 'csv', a dict, "
        "where it returns a list of MetricsSinkInfo",
    ),
    (
        "sexpgpu_metrics_sinks",
        (_sink(),),
        "its sexpgpu_metrics_sinks returned a tuple, where it returns a list of MetricsSinkInfo",
    ),
    (
        "sexpgpu_metrics_sinks",
        None,
        "its sexpgpu_metrics_sinks returned None, where it returns a list of MetricsSinkInfo",
    ),
    (  # a descriptor of another hook, though it has the same fields
        "sexpgpu_evaluators",
        [_sink()],
        "its sexpgpu_evaluators returned a list holding a MetricsSinkInfo, "
        "where it returns a list of EvaluatorInfo",
    ),
    (  # a duck-typed stand-in with every required field is taken
        "sexpgpu_evaluators",
        [SimpleNamespace(name="runner", factory=lambda metrics: None)],
        None,
    ),
    (
        "sexpgpu_storage_backends",
        [SimpleNamespace(schemes=("x",))],
        "its sexpgpu_storage_backends returned a list holding a SimpleNamespace, "
        "where it returns a list of StorageBackendInfo",
    ),
    ("sexpgpu_storage_backends", [StorageBackendInfo(("x",), lambda uri: None)], None),
    ("sexpgpu_unavailable", None, None),
    (
        "sexpgpu_unavailable",
        3,
        "its sexpgpu_unavailable returned int 3, where it returns str or None",
    ),
    ("sexpgpu_cli_commands", None, None),
    (
        "sexpgpu_cli_commands",
        click.Command("hello"),
        "its sexpgpu_cli_commands returned a Command, where it returns None",
    ),
]


@pytest.mark.parametrize(("hook", "answer", "reason"), HOOK_ANSWERS)
def test_each_hook_s_answer_is_held_to_the_type_it_declares(
    hook: str, answer: Any, reason: str | None
) -> None:
    assert _refusal(hook, answer) == reason


def test_a_reason_from_sexpgpu_unavailable_is_no_refusal() -> None:
    catalog = Catalog.of({**OURS, "mine": _hooked("sexpgpu_unavailable", "needs a GPU")})
    mine = catalog.record("mine")
    assert (mine.state, mine.reason, mine.refused) == ("unavailable", "needs a GPU", False)


def test_a_refused_plugin_s_descriptors_are_named_where_they_are_asked_for() -> None:
    catalog = Catalog.of({**OURS, "mine": _hooked("sexpgpu_metrics_sinks", _sink())})
    with pytest.raises(PluginError) as caught:
        catalog.metrics_sink("csv")
    assert str(caught.value) == (
        f"the metrics sink 'csv' needs the plugin 'mine', which is refused: {REFUSED_SINK}"
    )
    assert catalog.metrics_sink("jsonl").name == "jsonl"  # every other sink as before
    assert {i.name for i in catalog.available("sexpgpu_metrics_sinks")} == {"jsonl"}


def _op(spec: OpSpec) -> OpInfo:
    return OpInfo(spec.name, spec, {})


def _source(options: dict, name: str = "src") -> DataSourceInfo:
    return DataSourceInfo(name, options, lambda o, s, b: {}, lambda o, s, b, seed: None)


DECLARATIONS = [
    ("sexpgpu_optimizers", _optimizer({"lr": 0.1, "weight-decay": 0.0, "no_decay": ("x",)}), None),
    ("sexpgpu_optimizers", _optimizer({"lr": None, "beta1": 0.9, "nesterov": False}), None),
    (
        "sexpgpu_optimizers",
        _optimizer({"lr": 0.1, "weight_decay": 0.0, "weight-decay": 0.1}),
        "its optimizer 'opt' declares the options 'weight_decay' and 'weight-decay', "
        "both written :weight-decay",
    ),
    (
        "sexpgpu_optimizers",
        _optimizer({"lr": 0.1, "clip": 1.0}),
        "its optimizer 'opt' declares the option 'clip', which no .sx file can set "
        "(:clip is sexpgpu's)",
    ),
    (
        "sexpgpu_optimizers",
        _optimizer({"lr": 0.1, "betas": {"b1": 0.9}}),
        "its optimizer 'opt': its option 'betas' defaults to a dict, which is no value of "
        "the language (a number, true/false, a string, a list of words, None)",
    ),
    (
        "sexpgpu_optimizers",
        _optimizer({"lr": float("nan")}),
        "its optimizer 'opt': its option 'lr' defaults to float nan, which is no value of "
        "the language (a number, true/false, a string, a list of words, None)",
    ),
    (
        "sexpgpu_optimizers",
        _optimizer({"lr": 0.1, "tags": ("no decay",)}),
        "its optimizer 'opt': its option 'tags' defaults to a tuple, which is no value of "
        "the language (a number, true/false, a string, a list of words, None)",
    ),
    (
        "sexpgpu_optimizers",
        _optimizer({"lr": 0.1}, name="my opt"),
        "its optimizer 'my opt' has a name no .sx file can write "
        "(a name is a letter, then letters, digits, '-' or '_')",
    ),
    (
        "sexpgpu_optimizers",
        _optimizer(["lr"]),  # type: ignore[arg-type]
        "its optimizer 'opt' declares its options as a list, not a name -> default mapping",
    ),
    (
        "sexpgpu_data_sources",
        _source({"path": "", "shuffle?": True}),
        "its data source 'src' declares options no .sx file can write: 'shuffle?' "
        "(a name is a letter, then letters, digits, '-' or '_')",
    ),
    ("sexpgpu_data_sources", _source({"path": "", "seed-offset": 3}), None),
    (
        "sexpgpu_ops",
        _op(OpSpec("widen", "", same_float, (Arg("x"),), (Keyword("by factor", "int", 2),))),
        "its op 'widen' declares options no .sx file can write: 'by factor' "
        "(a name is a letter, then letters, digits, '-' or '_')",
    ),
    (
        "sexpgpu_ops",
        _op(OpSpec("widen", "", same_float, (Arg("x"),), surface=("widen!",))),
        "its op 'widen' is called 'widen!', which no .sx file can write "
        "(a name is a letter, then letters, digits, '-' or '_')",
    ),
    (
        "sexpgpu_ops",
        _op(OpSpec("widen", "", same_float, (Arg("x"),), (Keyword("by", "int"),))),
        None,
    ),
]


@pytest.mark.parametrize(("hook", "info", "reason"), DECLARATIONS)
def test_names_and_defaults_a_sx_file_cannot_write_refuse_the_plugin(
    hook: str, info: Any, reason: str | None
) -> None:
    assert _refusal(hook, [info]) == reason


def test_sexpgpu_s_own_plugins_keep_every_contract() -> None:
    catalog = Catalog.load()  # the installed ones: the suite disables any third party's
    for hook in SUPPLIES:
        catalog.supplied(hook)
    assert len(catalog.records) >= 10
    assert [(r.name, r.reason) for r in catalog.records if not r.available] == []


def test_a_data_source_whose_prompt_length_fails_is_named_at_the_sample_form() -> None:
    """Any callable of a plugin's that a compile calls is held so: a data source's
    ``prompt_length`` (for a generator's prompts), as an op's ``infer``."""

    def broken_count(options: Any, seq: int) -> int:
        raise KeyError("length")

    (sort,) = [i for i in sexpgpu_data.data_sources() if i.name == "sort"]
    cards = dataclasses.replace(sort, name="cards", prompt_length=broken_count)
    catalog = Catalog.of(
        {**OURS, "eval": sexpgpu_eval, "cards": _hooked("sexpgpu_data_sources", [cards])}
    )
    text = generating.source().replace("(defdata train (sort", "(defdata train (cards")
    with pytest.raises(PluginError) as caught:
        lang.compile_text(text, generating.FILE, catalog=catalog)
    assert str(caught.value) == (
        f"{generating.SAMPLE}: E-PLUGIN-002: the data source 'cards' of the plugin 'cards': "
        "its prompt_length raised KeyError: 'length'"
    )
    assert lang.compile_text(generating.source(), generating.FILE, catalog=catalog).stages

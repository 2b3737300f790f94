"""A catalog made by hand: the compiler, the session and a whole run take what they are
handed, and nothing reads the installed entry points behind their back."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

import sexpgpu_data
import sexpgpu_eval
import sexpgpu_jsonl
import sexpgpu_local
import sexpgpu_torch
from sexpgpu.catalog import Catalog
from sexpgpu.errors import PluginError, SourceError
from sexpgpu.extension import OptimizerInfo
from sexpgpu.session import Selection, Session, Target
from sexpgpu.train import RunOptions, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OURS = {
    "torch": sexpgpu_torch,
    "data": sexpgpu_data,
    "eval": sexpgpu_eval,
    "jsonl": sexpgpu_jsonl,
    "local": sexpgpu_local,
}


@pytest.fixture
def no_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the installed sexpgpu plugins fails loudly from here on (other groups,
    which torch reads as it imports, are left alone)."""
    read = metadata.entry_points

    def refuse(*args, **kwargs):
        if kwargs.get("group") == "sexpgpu":
            raise AssertionError("the sexpgpu entry points were read")
        return read(*args, **kwargs)

    monkeypatch.setattr(metadata, "entry_points", refuse)


def test_a_hand_made_catalog_has_what_it_was_given_and_nothing_else(no_entry_points) -> None:
    with pytest.raises(AssertionError, match="entry points were read"):
        Catalog.load()  # the guard holds
    catalog = Catalog.of(OURS)
    assert [r.name for r in catalog.records] == sorted(OURS)
    assert all(r.available and r.distribution == "sexpgpu" for r in catalog.records)
    assert {info.name for info in catalog.lowerings()} == {"torch", "compiled"}
    assert sorted(catalog.optimizers()) == ["adam", "adamw", "sgd"]
    with pytest.raises(PluginError, match=r"no installed plugin supplies the location s3://b/r"):
        catalog.open_location("s3://b/r")


def test_an_optimizer_names_its_plugin_and_a_duck_typed_one_is_taken_as_its_descriptor(
    no_entry_points,
) -> None:
    from types import SimpleNamespace

    from sexpgpu.hookspecs import hookimpl

    # a stand-in has every field the descriptor requires (a misfit refuses its plugin)
    duck = SimpleNamespace(
        name="duck", options={"lr": 0.1}, state_names=lambda o: (), factory=object, doc=""
    )

    class Ducks:
        @hookimpl
        def sexpgpu_optimizers(self):
            return [duck]

    optimizers = Catalog.of({**OURS, "ducks": Ducks()}).optimizers()
    assert optimizers["adam"].plugin == "torch"  # for the lowering's messages
    # the stand-in is handed on as the descriptor it stands in for, its optional
    # fields at their defaults, so nothing that uses it asks what it has
    taken = optimizers["duck"]
    assert isinstance(taken, OptimizerInfo)
    assert (taken.name, taken.options, taken.factory, taken.plugin) == (
        "duck",
        {"lr": 0.1},
        object,
        "ducks",
    )


def test_a_program_compiles_lowers_and_trains_from_a_hand_made_catalog(no_entry_points) -> None:
    catalog = Catalog.of(OURS)
    session = Session.start(catalog, Selection(str(EXAMPLES / "my-run.sx")), Target())
    trainer = session.lower("cpu")
    assert session.fill() == []
    assert session.made["lowering"] == "torch"
    from sexpgpu.session import open_loader

    _, loader = open_loader(catalog, session.program.stages[0].data, session.program.run.seed)
    proposal = trainer.propose(loader.next_batch(), stage=0, step=1, lr=0.5)
    assert trainer.find_non_finite(proposal) is None
    trainer.commit(proposal)
    assert proposal.loss > 0


def test_what_the_catalog_lacks_is_refused_where_it_is_used(no_entry_points) -> None:
    without_data = Catalog.of({k: v for k, v in OURS.items() if k != "data"})
    with pytest.raises(SourceError, match=r"unknown data source 'arithmetic'"):
        Selection(str(EXAMPLES / "my-run.sx")).compile(without_data)
    without_lowering = Catalog.of({k: v for k, v in OURS.items() if k != "torch"})
    program = Selection(str(EXAMPLES / "my-run.sx")).compile(
        Catalog.of({**OURS, "torch": sexpgpu_torch})
    )
    from sexpgpu.session import lower

    with pytest.raises(PluginError, match=r"the device 'cpu'"):
        lower(program, without_lowering, device="cpu", choices=Target().choices(program, None))


def test_a_whole_run_checkpoints_from_a_hand_made_catalog(no_entry_points, tmp_path) -> None:
    options = RunOptions(
        Selection(str(EXAMPLES / "my-run.sx"), steps=2),
        metrics_dir=str(tmp_path / "m"),
        metrics_sinks=("jsonl",),
        checkpoint_dir=str(tmp_path / "ck"),
    )
    outcome = run(options, Catalog.of(OURS))
    assert (outcome.exit_code, outcome.step) == (0, 2)
    experiment = json.loads((tmp_path / "ck" / "step-00000002" / "experiment.json").read_text())
    assert experiment["finished"] and experiment["choices"]["lowering"] == "torch"
    (events,) = (tmp_path / "m").glob("*/events.jsonl")
    assert json.loads(events.read_text().splitlines()[-1])["kind"] == "done"

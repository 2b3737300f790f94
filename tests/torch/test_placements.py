"""The torch trainer's placements (``sexpgpu_torch.placement``), in-process: the one
each recorded ``shard`` names, the answers the core reads from it, the placement the
warm-up runs on, and how owners split the parameters. Nothing here runs a collective
(placing a trainer takes none); the runs on several ranks are tests/distributed's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import sexpgpu_torch.trainer
from sexpgpu_torch.placement import BY_SHARD, Single
from sexpgpu_torch.placement.fully_sharded import FullySharded
from sexpgpu_torch.placement.owned import OwnedAlone
from sexpgpu_torch.placement.replicated import Replicated
from tests.catalogs import RankOf, compile_file, lower

PROGRAM = Path(__file__).resolve().parents[1] / "distributed" / "full.sx"
"""Two repeated blocks (an unrolled stack, inlined alone), a scalar, tables of 17 rows."""

ANSWERS = {  # exports_together, holds_replicas, evaluates_together
    None: (False, True, False),
    "none": (False, True, False),
    "optimizer": (True, True, False),
    "full": (True, False, True),
}


@pytest.fixture(scope="module")
def program():
    return compile_file(str(PROGRAM))


def placed(program, shard: str | None, rank: int = 0):
    """A trainer of ``program`` alone (``shard`` None) or as ``rank`` of two."""
    trainer = lower(program)
    if shard is not None:
        trainer.shard = shard
        trainer.use_group(RankOf(rank))
    return trainer


@pytest.mark.parametrize("shard", [None, "none", "optimizer", "full"])
def test_each_shard_has_its_placement_and_the_answers_the_core_reads(program, shard) -> None:
    trainer = placed(program, shard)
    kind = Single if shard is None else BY_SHARD[shard]
    assert type(trainer.placement) is kind
    answers = (trainer.exports_together, trainer.holds_replicas, trainer.evaluates_together)
    assert answers == ANSWERS[shard]
    assert trainer.choices.get("shard") == shard  # one device records none


def test_the_warm_up_runs_alone_on_replicas_and_through_the_slices_when_sharded(program) -> None:
    alone = placed(program, None).placement
    assert alone.warm_up_placement() is alone
    replicas = placed(program, "none").placement
    assert type(replicas.warm_up_placement()) is Single  # no DDP: no rank waits for it
    owner = placed(program, "optimizer").placement
    warming = owner.warm_up_placement()
    assert type(warming) is OwnedAlone  # its updates compile for what it owns
    every = list(range(sum(d.trainable for d in program.params)))
    assert warming.mine(every) == owner.mine(every) != every
    new = [object()] * len(every)
    assert warming.share(new, []) is new  # nothing sent while warming up
    sliced = placed(program, "full").placement
    assert sliced.warm_up_placement() is sliced  # FSDP2's slices are made there


def test_owners_split_the_parameters_and_keep_only_their_states(program) -> None:
    every = list(range(sum(d.trainable for d in program.params)))
    mine = [placed(program, "optimizer", rank).placement.mine(every) for rank in (0, 1)]
    assert sorted(mine[0] + mine[1]) == every and not set(mine[0]) & set(mine[1])
    owner = placed(program, "optimizer", 1).placement
    assert [owner.state_position(i) for i in mine[1]] == list(range(len(mine[1])))
    assert {owner.state_position(i) for i in mine[0]} == {None}


def test_full_shards_inline_no_repeat_and_compile_the_graphs_again(program) -> None:
    trainer = lower(program)
    unrolled = trainer.stage_loss
    assert trainer.choices["stack:model.blocks"] == "unrolled"
    trainer.use_group(RankOf(0))  # full.sx says :shard full
    assert isinstance(trainer.placement, FullySharded)
    assert trainer.placement.inline_sites(frozenset({"stack:model.blocks"})) == frozenset()
    assert trainer.stage_loss is not unrolled  # each iteration goes through its unit
    replicas = placed(program, "none")
    assert isinstance(replicas.placement, Replicated)
    assert replicas.placement.inline_sites(frozenset({"x"})) == frozenset({"x"})


def test_the_trainer_names_no_placement_of_its_own() -> None:
    """The trainer asks its placement; it never imports one to test which it has."""
    source = Path(sexpgpu_torch.trainer.__file__).read_text()
    imported = {
        (node.module, alias.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("sexpgpu_torch.placement")
        for alias in node.names
    }
    assert {name for _, name in imported} <= {
        "HostCopies",
        "Model",
        "Placement",
        "Single",
        "placement_for",
    }
    assert {module for module, _ in imported} == {"sexpgpu_torch.placement"}
    named = re.findall(r"\b(isinstance|_alone|Owned|FullySharded|Replicated)\b", source)
    assert named == []

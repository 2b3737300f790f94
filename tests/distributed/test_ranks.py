"""The core's side of the ranks, without a launcher: one process alone, and the rules
a group of several must pass before any step."""

from __future__ import annotations

import pytest

from sexpgpu.errors import PluginError, UsageError
from sexpgpu.extension import LoweringInfo, RankGroup, Trainer
from sexpgpu.ranks import SOLO, Solo, check_batches, join_group
from sexpgpu.session import Lowered, Session
from tests.catalogs import compile_file, project

from .kit import HERE, PROGRAM


def test_one_process_alone_is_rank_0_of_1_and_answers_itself(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    group = join_group("cuda:1", [])
    assert isinstance(group, RankGroup)
    assert (group.rank, group.size, group.nodes, group.device) == (0, 1, 1, "cuda:1")
    assert group.is_writer and group.max(15) == 15 and group.same(b"anything")
    assert SOLO == Solo()


def test_several_ranks_need_a_lowering_that_can_join_them(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = LoweringInfo(name="alone", devices=("cpu",), factory=lambda: None)
    with pytest.raises(PluginError, match="no installed lowering can train on several 'cpu'"):
        join_group("cpu", [alone])
    joined = Solo(device="cpu", rank=1, size=2)
    able = LoweringInfo(name="able", devices=("cpu",), factory=lambda: None, group=lambda d: joined)
    assert join_group("cpu", [alone, able]) is joined


def test_the_global_batch_must_split_evenly_across_the_ranks():
    program = compile_file(str(HERE / PROGRAM))  # :batch 24
    check_batches(program, Solo(size=3))
    check_batches(program, Solo(size=1))
    with pytest.raises(UsageError, match="E-DP-001: the batch of 24 records does not split"):
        check_batches(program, Solo(size=5))


def test_a_trainer_for_one_device_is_refused_several():
    class OneDevice(Trainer):  # takes the protocol's default use_group
        choices = {}

    session = Session(project(), None, None)
    session.lowered = Lowered(OneDevice(), "mine", {})
    with pytest.raises(PluginError, match="^the lowering mine cannot train on several devices"):
        session.use_group(Solo(size=2))
    taken = []

    class Several(OneDevice):
        def use_group(self, group):
            taken.append(group)

    session.lowered = Lowered(Several(), "mine", {})
    session.use_group(Solo(size=2))
    assert taken == [Solo(size=2)]


class _Watch:
    """A stop watch that got ``signum`` (0: none)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    @property
    def stopping(self) -> bool:
        return bool(self.signum)

    def settle(self) -> tuple[str, int]:
        import signal

        return signal.Signals(self.signum).name, self.signum


class _Ranks(Solo):
    """Two ranks, the other of which got ``other`` (0: nothing)."""

    def __init__(self, other: int) -> None:
        super().__init__(size=2)
        object.__setattr__(self, "other", other)

    def max(self, value: int) -> int:
        return max(value, self.other)


@pytest.mark.parametrize(
    ("mine", "other", "agreed"),
    [(0, 0, None), (0, 1, "SIGHUP"), (15, 1, "SIGTERM"), (1, 2, "SIGINT"), (2, 15, "SIGTERM")],
)
def test_the_ranks_stop_together_on_the_strongest_signal(mine, other, agreed):
    from sexpgpu.ranks import StopAgreement

    stops = StopAgreement(_Ranks(other), _Watch(mine))
    assert stops.stopping() is (agreed is not None)
    if agreed:
        assert stops.settle()[0] == agreed
    # an eval pass in flight finishes on several ranks; one rank alone stops it
    assert not stops.pass_may_stop()
    assert StopAgreement(Solo(), _Watch(2)).pass_may_stop()

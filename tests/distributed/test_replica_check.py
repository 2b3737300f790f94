"""The end-of-run check that every rank holds the same model (``E-DP-003``), in-process:
replicas compare the digest of what ``export`` gives; ranks of slices
(``holds_replicas = False``) export nothing for it, and only wait together."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from sexpgpu.errors import RunError
from sexpgpu.extension import Trainer
from sexpgpu.ranks import check_replicas


class _Group:
    """Two ranks whose other rank sent ``theirs`` (``None``: whatever this one sends)."""

    size = 2

    def __init__(self, theirs: bytes | None = None) -> None:
        self.theirs, self.sent = theirs, []

    def same(self, data: bytes) -> bool:
        self.sent.append(data)
        return self.theirs is None or data == self.theirs


class _Replica(Trainer):  # holds_replicas: the protocol's default, True
    def __init__(self, value: float) -> None:
        self.exported = 0
        self.value = value

    def export(self, *, reuse: bool = False):
        self.exported += 1
        return {"w": np.full(3, self.value, np.float32)}, {"w/m": np.zeros(3, np.float32)}


class _Slices(_Replica):
    holds_replicas = False


def _digest_of(trainer) -> bytes:
    group = _Group()
    check_replicas(group, trainer, 7)
    return group.sent[0]


def test_replicas_that_drifted_are_e_dp_003_and_equal_ones_pass():
    ours = _digest_of(_Replica(1.0))
    check_replicas(_Group(ours), _Replica(1.0), 7)
    with pytest.raises(RunError) as caught:
        check_replicas(_Group(_digest_of(_Replica(2.0))), _Replica(1.0), 7)
    assert caught.value.code == "E-DP-003"
    assert str(caught.value) == "E-DP-003: the 2 ranks hold different parameters after step 7"


def test_ranks_of_slices_export_nothing_and_only_wait_together():
    sliced = _Slices(1.0)
    group = _Group(hashlib.sha256().digest())
    check_replicas(group, sliced, 7)
    assert sliced.exported == 0
    assert group.sent == [hashlib.sha256().digest()]  # the same from every rank

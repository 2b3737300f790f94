"""The cross-entropy of bf16 logits, chunk by chunk in f32 without an f32 copy of the
logits (sexpgpu_torch.cross_entropy), against ``F.cross_entropy`` of the upcast
logits: values and gradients, masked targets, eagerly and under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sexpgpu_torch import cross_entropy as ce


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    masked = torch.where(targets < 0, torch.full_like(targets, -100), targets)
    return F.cross_entropy(logits.float(), masked, ignore_index=-100)


def _case(rows: int, vocab: int, masked: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[:masked] = -1
    return logits.requires_grad_(), targets


@pytest.mark.parametrize(("rows", "vocab", "masked", "chunk"), [
    (37, 50, 5, 1 << 28),    # one chunk
    (37, 50, 5, 4 * 50 * 8),  # chunks of 8 rows, the last one short
    (64, 1000, 0, 4 * 1000 * 16),
    (8, 17, 8, 1 << 28),     # every target masked: NaN, and no gradient
])  # fmt: skip
def test_values_and_gradients_are_those_of_the_upcast_cross_entropy(
    monkeypatch, rows, vocab, masked, chunk
) -> None:
    monkeypatch.setattr(ce, "CHUNK_BYTES", chunk)
    logits, targets = _case(rows, vocab, masked)
    ours = ce.cross_entropy(logits, targets)
    expected = _reference(logits, targets)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_expected,) = torch.autograd.grad(expected, logits)
    assert g_ours.dtype == torch.bfloat16
    torch.testing.assert_close(g_ours.float(), g_expected.float(), rtol=1e-2, atol=1e-4)


def test_f32_logits_take_f_cross_entropy_itself_to_the_bit() -> None:
    logits, targets = _case(37, 50, 5)
    logits = logits.detach().float()
    assert torch.equal(ce.cross_entropy(logits, targets), _reference(logits, targets))


class _Allocations(TorchDispatchMode):
    """The largest f32 tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_f32_copy_of_the_logits_is_made_forward_or_backward(monkeypatch) -> None:
    monkeypatch.setattr(ce, "CHUNK_BYTES", 4 * 500 * 16)
    logits, targets = _case(128, 500, 3)
    with _Allocations() as seen:
        loss = ce.cross_entropy(logits, targets)
        loss.backward()
    assert seen.largest <= 16 * 500  # one chunk of rows at most, never all 128
    with _Allocations() as upcast:
        _reference(logits, targets).backward()
    assert upcast.largest == 128 * 500  # what the old way made


def test_under_torch_compile_it_gives_the_eager_values() -> None:
    logits, targets = _case(48, 64, 4)
    compiled = torch.compile(ce.cross_entropy, backend="aot_eager", fullgraph=True)
    ours = compiled(logits, targets)
    torch.testing.assert_close(ours, _reference(logits, targets), rtol=1e-5, atol=1e-5)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_eager,) = torch.autograd.grad(ce.cross_entropy(logits, targets), logits)
    torch.testing.assert_close(g_ours.float(), g_eager.float())

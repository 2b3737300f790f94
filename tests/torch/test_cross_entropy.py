"""The cross-entropy of bf16 logits. The eager lowering's goes chunk by chunk in f32
without an f32 copy of the logits (sexpgpu_torch.cross_entropy), checked against
``F.cross_entropy`` of the upcast logits: values and gradients, masked targets,
eagerly and under torch.compile. The compiled lowering's is the upcast one, which
inductor fuses: checked that AOTAutograd's partition (with inductor's
decompositions) keeps no f32 tensor of the logits' size for the backward; that a
bf16 program's loss reaches AOTAutograd's cache (a custom autograd function made it
pass the graph by, tracing it again at every start) is checked where the suite
compiles one in process, tests/torch/test_fused_update.py."""

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


def test_each_lowering_takes_its_own() -> None:
    from sexpgpu_torch.ops import IMPLEMENTATIONS

    class Low:
        fuses = False

    builder = IMPLEMENTATIONS["cross_entropy"]
    assert builder(None, Low(), None) is ce.cross_entropy
    Low.fuses = True
    assert builder(None, Low(), None) is ce.upcast_cross_entropy


def _saved_for_backward(fn, *args) -> list[torch.Tensor]:
    """What AOTAutograd's partitioner, on inductor's decompositions, keeps from the
    forward of ``fn(*args)`` for the backward."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    kept: list[torch.Tensor] = []

    def forward(gm, example_inputs):  # type: ignore[no-untyped-def]
        (output,) = [n for n in gm.graph.nodes if n.op == "output"]
        kept.extend(a.meta["val"] for a in output.args[0][1:])  # past the loss
        return gm

    backend = aot_autograd(
        fw_compiler=forward,
        bw_compiler=lambda gm, example_inputs: gm,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args).backward()
    return kept


def test_the_compiled_upcast_keeps_no_f32_copy_of_the_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=gen, requires_grad=True)
    table = torch.randn(1000, 32, generator=gen, requires_grad=True)
    targets = torch.randint(0, 1000, (64,), generator=gen)

    def loss(h, w, t):  # type: ignore[no-untyped-def]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = h @ w.T
        return ce.upcast_cross_entropy(logits, t)

    kept = _saved_for_backward(loss, hidden, table, targets)
    big = [t for t in kept if t.numel() >= 64 * 1000]
    assert [t.dtype for t in big] == [torch.bfloat16]  # the logits, as the product made them

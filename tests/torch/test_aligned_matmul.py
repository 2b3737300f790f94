"""On a GPU every matrix product's inner and outer dimension is padded to a multiple of
``cuda.align`` (64): cuBLAS falls back to Turing-era kernels for a 50257-wide
vocabulary otherwise (38% of a GPT-2 small step on an H200). Checked here on the CPU,
where the lowering pads nothing unless told: the padded product equals the declared
one, values and gradients, and every GEMM of a GPT-2 small training step, forward
and backward, gets aligned operands. The compiled lowering traces these same graph
functions (AOTAutograd records the same ATen products), so the eager step's products
are the compiled graphs'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sexpgpu.catalog import Catalog
from sexpgpu.lang.ir import TensorType
from sexpgpu.session import Selection, Target, lower, open_loader
from sexpgpu_torch import lowering as torch_lowering
from sexpgpu_torch.ops import _matmul

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt2-small.sx"
# GPT-2 small's widths (768, 12 heads, the 50257-token vocabulary); fewer layers,
# positions and rows, which set no leading dimension of a product (M)
SMALLER = {"layers": "2", "context": "64", "batch": "2"}
PLAIN = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default}
WITH_INPUT = {torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}


class _Products(TorchDispatchMode):
    """Records the (K, N) of every GEMM: the inner and the outer dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in PLAIN or func in WITH_INPUT:
            a, b = args[1:3] if func in WITH_INPUT else args[:2]
            self.seen.append((int(a.shape[-1]), int(b.shape[-1])))
        return func(*args, **(kwargs or {}))


class _Low:
    """A graph compiler's answers for one matmul node (ops.Lowerer)."""

    def __init__(self, a: tuple[int, ...], b: tuple[int, ...], align: int) -> None:
        self.types = [TensorType(a, "f32"), TensorType(b, "f32")]
        self.align = align

    def arg_type(self, node, i):  # type: ignore[no-untyped-def]
        return self.types[i]


@pytest.mark.parametrize(
    ("a", "b"), [((3, 5, 67), (67, 50)), ((7, 64), (64, 129)), ((2, 4, 9), (9, 1))]
)
def test_a_padded_product_is_the_declared_one_values_and_gradients(a, b) -> None:
    fn = _matmul(None, _Low(a, b, 64), None)
    assert fn is not torch.matmul
    assert _matmul(None, _Low(a, b, 0), None) is torch.matmul  # the CPU: nothing padded
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(a, generator=gen, requires_grad=True)
    w = torch.randn(b, generator=gen, requires_grad=True)
    ours = fn(x, w)
    assert ours.shape == torch.matmul(x, w).shape
    torch.testing.assert_close(ours, torch.matmul(x, w))
    gx, gw = torch.autograd.grad(ours.square().sum(), (x, w))
    ex, ew = torch.autograd.grad(torch.matmul(x, w).square().sum(), (x, w))
    torch.testing.assert_close(gx, ex, rtol=1e-4, atol=1e-4)  # other summation orders
    torch.testing.assert_close(gw, ew, rtol=1e-4, atol=1e-4)


def _gpt2_step_products(monkeypatch, align: int) -> list[tuple[int, int]]:
    aligned = {"cuda.align": str(align)} if align else {}
    monkeypatch.setattr(torch_lowering, "take_alignment", lambda device, pins: (align, aligned))
    catalog = Catalog.load()
    program = Selection(str(EXAMPLE), sets=SMALLER).compile(catalog)
    choices = Target(device="cpu", lowering="torch").choices(program, None)
    trainer = lower(program, catalog, device="cpu", choices=choices).trainer
    assert trainer.choices.get("cuda.align") == aligned.get("cuda.align")
    trainer.init_params()
    _, loader = open_loader(catalog, program.stages[0].data, program.run.seed)
    with _Products() as products:
        trainer.propose(loader.next_batch(), stage=0, step=1, lr=1e-4)
    return products.seen


def test_every_gemm_of_a_gpt2_small_step_is_aligned_when_asked(monkeypatch) -> None:
    seen = _gpt2_step_products(monkeypatch, 64)
    assert len(seen) >= 2 * 6 * 3  # q, k, v, out, up, down per block, forward and backward
    assert [(k, n) for k, n in seen if k % 64 or n % 64] == []


def test_without_alignment_the_vocabulary_reaches_cublas_as_declared(monkeypatch) -> None:
    seen = _gpt2_step_products(monkeypatch, 0)
    assert any(50257 in pair for pair in seen)  # what the check above would catch

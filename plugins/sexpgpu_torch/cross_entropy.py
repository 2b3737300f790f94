"""Cross-entropy of bf16 logits without an f32 copy of them.

``F.cross_entropy(logits.float(), ...)`` run eagerly on GPT-2 small's bf16 logits
(16,384 rows of 50,257) makes a 3.3 GB f32 copy, and keeps its 3.3 GB log-softmax
for the backward. So the eager lowering takes the rows a chunk at a time
(:func:`cross_entropy`): each chunk is raised to f32,
its log-sum-exp and target logit read, and the chunk let go; the backward raises
each chunk again and writes its gradient in the logits' dtype. What is kept between
the two is the bf16 logits (alive anyway) and one f32 number per row, and no
chunk's f32 copy is larger than :data:`CHUNK_BYTES`. The sums are f32, as
``F.cross_entropy`` of the upcast logits takes them; f32 logits keep
``F.cross_entropy`` itself (its bits are the CPU runs' recorded ones).

Under ``torch.compile`` none of this is needed, and the chunks would cost: inductor
fuses the upcast into the log-softmax's reductions and AOTAutograd's partitioner
keeps the bf16 logits and two f32 numbers per row for the backward, which it
recomputes in one fused pass, so the upcast cross-entropy itself
(:func:`upcast_cross_entropy`) holds no f32 copy; and a custom autograd function
in the graph would make AOTAutograd's cache pass the graph by, tracing it again at
every start. The compiled lowering takes that one.

Negative targets are masked out, as in ``cross-entropy``: they count neither in the
sum nor in the mean (every one masked: NaN, as ``F.cross_entropy`` gives).
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor

CHUNK_BYTES = 1 << 28
"""The f32 bytes of one chunk of rows (256 MiB: 1,335 rows of a 50,257 vocabulary)."""


def _chunks(rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // (4 * max(1, width)))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


class ChunkedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of ``logits`` ``[rows, vocab]`` (any float dtype)
    against ``targets`` ``[rows]`` (negative: masked), chunk by chunk in f32."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor) -> Tensor:  # type: ignore[override]
        valid = targets >= 0
        picked = targets.clamp(min=0)
        lse = logits.new_empty(logits.shape[0], dtype=torch.float32)
        total = logits.new_zeros((), dtype=torch.float32)
        for start, stop in _chunks(*logits.shape):
            chunk = logits[start:stop].float()
            lse[start:stop] = torch.logsumexp(chunk, dim=-1)
            target = chunk.gather(1, picked[start:stop, None]).squeeze(1)
            total = total + ((lse[start:stop] - target) * valid[start:stop]).sum()
        # every target masked: NaN, and no gradient, as F.cross_entropy gives
        count = valid.sum().to(torch.float32)
        ctx.save_for_backward(logits, picked, valid, lse, count)
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        logits, picked, valid, lse, count = ctx.saved_tensors
        out = torch.empty_like(logits)
        scale = grad.to(torch.float32) / count
        for start, stop in _chunks(*logits.shape):
            probs = torch.exp(logits[start:stop].float() - lse[start:stop, None])
            rows = torch.arange(stop - start, device=logits.device)
            probs[rows, picked[start:stop]] -= 1.0
            weight = torch.where(valid[start:stop], scale, 0.0)[:, None]
            out[start:stop] = (probs * weight).to(logits.dtype)
        return out, None


def upcast_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean cross-entropy over every position but the masked ones (negative
    targets), of ``logits`` ``[..., vocab]`` raised to f32 (a no-op for f32);
    ``targets`` the leading shape. What a fusing compiler should see."""
    flat = targets.reshape(-1)
    rows = logits.reshape(-1, logits.shape[-1]).float()
    masked = torch.where(flat < 0, torch.full_like(flat, -100), flat)
    return torch.nn.functional.cross_entropy(rows, masked, ignore_index=-100)


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """:func:`upcast_cross_entropy`'s value, for bf16 logits chunk by chunk
    (:class:`ChunkedCrossEntropy`); f32 logits take ``F.cross_entropy`` itself."""
    if logits.dtype == torch.float32:
        return upcast_cross_entropy(logits, targets)
    return ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

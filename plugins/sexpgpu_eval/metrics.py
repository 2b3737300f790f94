"""The built-in eval metrics and the ``top-k-accuracy`` op they use.

A metric is `.sx` text giving one scalar per batch (see
:class:`sexpgpu.extension.EvalMetricInfo`), so it is computed on the device by
whichever lowering runs the pass, and the same graph serves a run's own pass
and ``sexpgpu evaluate``. Only the mean over the batches is finished on the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.extension import EvalMetricInfo, OpInfo
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops import Arg, Keyword, OpSpec, check_float, fail

TOP_K = 5
"""The ``k`` of the built-in ``top-k-accuracy`` metric."""


def _bits(mean_loss: float) -> float:
    return mean_loss / math.log(2.0)


def _perplexity(mean_loss: float) -> float:
    # A diverged run has a huge loss: say infinity rather than fail on overflow.
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf


BUILT_IN: tuple[EvalMetricInfo, ...] = (
    EvalMetricInfo("loss", "loss", doc="the run's :loss, averaged over the pass's batches"),
    EvalMetricInfo(
        "accuracy",
        "(accuracy logits targets)",
        doc="share of positions whose highest logit is the target (negative targets skipped)",
    ),
    EvalMetricInfo(
        "perplexity", "loss", _perplexity, doc="exp of the mean loss (a cross-entropy in nats)"
    ),
    EvalMetricInfo(
        "bits-per-char", "loss", _bits, doc="the mean loss in bits (nats / ln 2) per position"
    ),
    EvalMetricInfo(
        "top-k-accuracy",
        f"(top-k-accuracy logits targets :k {TOP_K})",
        doc=f"share of positions whose target is among the {TOP_K} highest logits",
    ),
    EvalMetricInfo(
        "reward", "(mean reward)", doc="a generating pass's mean reward over its records"
    ),
    EvalMetricInfo(
        "generated-length",
        "(mean (sum completion-mask :axis 1))",
        doc="a generating pass's tokens made per record, its stop token included",
    ),
)
"""``loss``, ``accuracy``, ``perplexity``, ``bits-per-char``, ``top-k-accuracy``, and for a
pass that generates (docs/generate.md) ``reward`` and ``generated-length``."""


def _top_k_type(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    logits, targets = args
    if not logits.shape:
        raise fail(op, f"logits must be [..., classes], got {logits}", pos)
    check_float(op, logits, pos, "the logits")
    if targets.dtype != "i64" or targets.shape != logits.shape[:-1]:
        raise fail(op, f"targets must be i64 {list(logits.shape[:-1])}, got {targets}", pos)
    if attrs["k"] > logits.shape[-1]:
        raise fail(op, f":k {attrs['k']} is more than the {logits.shape[-1]} classes", pos)
    return TensorType((), "f32")


TOP_K_SPEC = OpSpec(
    name="top_k_accuracy",
    doc="share of positions whose target is among the k highest logits (negative targets skipped)",
    infer=_top_k_type,
    args=(Arg("logits"), Arg("targets", like="i64")),
    keywords=(Keyword("k", "int", TOP_K, low=1),),
)


def _torch_top_k() -> Any:
    import torch

    def build(attrs: Mapping[str, Any]) -> Any:
        k = int(attrs["k"])

        def top_k_accuracy(logits: Any, targets: Any) -> Any:
            scored = targets >= 0
            # A target is in the top k when fewer than k logits beat it: a count
            # instead of torch.topk, whose order among equal logits is unspecified.
            safe = targets.clamp(min=0).unsqueeze(-1)
            target_logit = torch.gather(logits, -1, safe)
            beaten_by = (logits > target_logit).sum(dim=-1)
            hits = (beaten_by < k) & scored
            return hits.sum().float() / scored.sum().clamp(min=1).float()

        return top_k_accuracy

    return build


TOP_K_OP = OpInfo(
    name="top_k_accuracy",
    spec=TOP_K_SPEC,
    implementations={"torch": _torch_top_k},
    doc=TOP_K_SPEC.doc,
)

"""The IR's dtypes as torch's (the op table, the graph compiler and the trainer
share this one table)."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "bool": torch.bool,
}
"""IR dtype names to torch dtypes."""

"""Write the token file examples/gpt2-small.sx trains on: GPT-2 ids (uint16, as
nanoGPT's prepare.py writes train.bin), generated here so nothing is downloaded.

The stream is synthetic: ids drawn from a Zipf-like law over GPT-2's 50257-token
vocabulary, with short repeated phrases so there is something to learn. Replace the
file with a real tokenised corpus (nanoGPT's openwebtext/prepare.py) for real work.

    python examples/make_gpt2_tokens.py [OUT] [TOKENS]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

VOCAB = 50257
DEFAULT_TOKENS = 16 * 1024 * 4 + 1  # four batches of 16 x 1024, and the last target


def tokens(count: int, seed: int = 0) -> np.ndarray:
    """``count`` synthetic GPT-2 token ids."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
    weights = 1.0 / ranks**1.1
    phrases = rng.choice(VOCAB, size=(512, 8), p=weights / weights.sum())
    picks = rng.integers(0, len(phrases), size=count // 8 + 1)
    return phrases[picks].reshape(-1)[:count].astype(np.uint16)


def main() -> None:
    """Write the file (default: gpt2-tokens.bin beside this script)."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("gpt2-tokens.bin")
    count = int(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_TOKENS
    tokens(count).tofile(out)
    print(f"wrote {count} tokens to {out}")


if __name__ == "__main__":
    main()

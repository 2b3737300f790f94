"""Seeds derived from the run's seed and what a draw is for (no torch here).

Every random draw of the torch lowering takes a fresh ``torch.Generator``
seeded from :func:`derive_seed`, never the global generator, so a draw depends
only on its purpose and a resumed run needs no hidden generator state:

- parameter ``path``'s initial value: ``derive_seed(seed, "init", path)``;
- dropout node ``key`` at global step ``step``: ``derive_seed(seed, "dropout", step, key)``,
  with the iteration appended (``..., key, i)``) inside the ``i``-th iteration of a ``repeat``.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``: the first 8 bytes of the sha256 of their text.

    Each part is written with its type's initial so that ``1`` and ``"1"`` differ,
    and parts are separated by a byte that cannot occur in their text.
    """
    text = "\x1f".join(f"{type(part).__name__[0]}:{part}" for part in parts)
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF

"""How ``sexpgpu evaluate`` says what is wrong with a checkpoint: on one line.

Reading a checkpoint for evaluation is the core's (:class:`sexpgpu.session.
CheckpointOpener`: as a resume reads it, less); this plugin only words its errors.
"""

from __future__ import annotations

from sexpgpu.errors import SexpError


def one_line(error: SexpError) -> SexpError:
    """``error`` with its lines joined by ``; ``: evaluate says everything on one line."""
    lines = [line.strip() for line in error.message.splitlines() if line.strip()]
    return type(error)("; ".join(lines), code=error.code)

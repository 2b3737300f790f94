"""The ``gate`` op the generator tests place in a model's forward, so a signal lands in a
chosen trip of a generator whatever the machine's speed.

``gate`` is the identity, declared position-wise, so a generator runs through its
key/value cache (a trip is one run of its prefill or step function). It counts its
calls without gradients (one per trip of a generator, when nothing else runs the model
without gradients) in ``$GATE_DIR/rank-<RANK>/trip-<n>``, passes over the compiled
lowering's warm-up (zero stand-ins), and on rank 0 at the ``$GATE_AT``-th call waits
until the test creates ``rank-0/release``.
"""

from __future__ import annotations

from pathlib import Path

from tests.foundation.pluginkit import make_plugin

GATE_PLUGIN = '''
"""gate: the identity; its GATE_AT-th call without gradients waits for the test."""

import os
import time
from pathlib import Path

from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, OpSpec, same_float


def _torch():
    import torch

    def build(attrs):
        def gate(x):
            if x.device.type == "meta" or torch.is_grad_enabled():
                return x
            if not bool(x.abs().sum()):  # the compiled lowering's warm-up: zero stand-ins
                return x
            folder = Path(os.environ["GATE_DIR"]) / f"rank-{os.environ.get('RANK', '0')}"
            folder.mkdir(parents=True, exist_ok=True)
            calls = len(list(folder.glob("trip-*"))) + 1
            (folder / f"trip-{calls}").touch()
            held = os.environ.get("RANK", "0") == "0"  # on several ranks, rank 0 alone
            if held and calls == int(os.environ.get("GATE_AT", "0")):
                bound = time.monotonic() + 120
                while not (folder / "release").exists() and time.monotonic() < bound:
                    time.sleep(0.005)
            return x

        return gate

    return build


SPEC = OpSpec(
    "gate", "x, held at one trip of a generator", same_float, (Arg("x"),), positionwise=True
)


@hookimpl
def sexpgpu_ops():
    return [OpInfo("gate", SPEC, {"torch": _torch}, SPEC.doc)]
'''


GATED_LM = """(defmodel lm (vocab seq dim)
  (layer embed (embedding vocab dim))
  (param pos [seq dim] :init (normal 0.02))
  (layer block (transformer-block dim 2))
  (layer head (linear dim vocab))
  (forward (ids) (head (block (gate (+ (embed ids) pos))))))
"""
"""A one-block causal transformer whose forward passes through ``gate``; ``(lm 8 8 16)``
fits ``(sort :vocab 8 :length 3) :seq 8``: a prompt of 4 tokens and 4 new ones."""


def make_gate_plugin(root: Path) -> Path:
    """The gate plugin's folder (for PYTHONPATH) under ``root``."""
    return make_plugin(
        root, "sexpgpu-gate", {"sexpgpu_gate": GATE_PLUGIN}, {"gate": "sexpgpu_gate"}
    )

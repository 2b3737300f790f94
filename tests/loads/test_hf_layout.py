"""A BERT-style encoder in the Hugging Face layout (``model.safetensors`` and a sharded
``model.safetensors.index.json``, with the tensor names such files use) read through a
``:names`` template, and its output checked against the same layers in plain PyTorch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from .helpers import experiment, run_sexpgpu

DIM, HEADS, HIDDEN, LAYERS, TIME, RECORDS = 16, 2, 32, 2, 5, 4

PROGRAM = """\
(deflayer dense (in out)
  (param weight [out in] :init (normal 0.02))
  (param bias [out] :init zeros)
  (forward (x) (+ (matmul x (transpose weight)) bias)))

(deflayer norm (dim)
  (param weight [dim] :init ones)
  (param bias [dim] :init zeros)
  (forward (x) (layer-norm x weight bias :eps 1e-12)))

(deflayer add-norm (in dim)
  (layer dense (dense in dim))
  (layer LayerNorm (norm dim))
  (forward (h x) (LayerNorm (+ (dense h) x))))

(deflayer self-attention (dim heads)
  (layer query (dense dim dim))
  (layer key (dense dim dim))
  (layer value (dense dim dim))
  (forward (x) (attention (query x) (key x) (value x) :heads heads :causal false)))

(deflayer attention-block (dim heads)
  (layer self (self-attention dim heads))
  (layer output (add-norm dim dim))
  (forward (x) (output (self x) x)))

(deflayer intermediate (dim hidden)
  (layer dense (dense dim hidden))
  (forward (x) (gelu (dense x))))

(deflayer bert-layer (dim heads hidden)
  (layer attention (attention-block dim heads))
  (layer intermediate (intermediate dim hidden))
  (layer output (add-norm hidden dim))
  (forward (x) (let [a (attention x)] (output (intermediate a) a))))

(deflayer encoder (dim heads hidden)
  (layer layer (repeat {layers} (bert-layer dim heads hidden)))
  (forward (x) (layer x)))

(defmodel scale (dim)
  (param w [dim] :init ones)
  (forward (x) (* x w)))

(defdata train (npy :features "features.npy" :labels "labels.npy") :batch {records})

(defrun hf
  :model (scale {dim})
  :with-loaded (bert (encoder {dim} {heads} {hidden}) :file "{file}" :names "encoder.{{name}}")
  :data train
  ; the loss is the distance of the .sx encoder's output from plain PyTorch's; the
  ; trainable scale is only there to give the run something to train
  :loss (+ (mse (bert inputs) targets) (* 0.0 (mean (model inputs))))
  :optimizer (sgd :lr 0.0)
  :steps 1
  :seed 1)
"""


def hf_tensors() -> dict[str, torch.Tensor]:
    """A small BERT encoder's tensors, named as Hugging Face names them."""
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "attention.self.query.weight": (DIM, DIM),
        "attention.self.query.bias": (DIM,),
        "attention.self.key.weight": (DIM, DIM),
        "attention.self.key.bias": (DIM,),
        "attention.self.value.weight": (DIM, DIM),
        "attention.self.value.bias": (DIM,),
        "attention.output.dense.weight": (DIM, DIM),
        "attention.output.dense.bias": (DIM,),
        "attention.output.LayerNorm.weight": (DIM,),
        "attention.output.LayerNorm.bias": (DIM,),
        "intermediate.dense.weight": (HIDDEN, DIM),
        "intermediate.dense.bias": (HIDDEN,),
        "output.dense.weight": (DIM, HIDDEN),
        "output.dense.bias": (DIM,),
        "output.LayerNorm.weight": (DIM,),
        "output.LayerNorm.bias": (DIM,),
    }
    return {
        f"encoder.layer.{i}.{name}": torch.randn(shape, generator=gen) * 0.3
        + (1.0 if name.endswith("LayerNorm.weight") else 0.0)
        for i in range(LAYERS)
        for name, shape in shapes.items()
    }


def plain_bert(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The encoder written in plain PyTorch, as Hugging Face's BertLayer computes it."""
    b, n, _ = x.shape
    for i in range(LAYERS):
        p = {k.removeprefix(f"encoder.layer.{i}."): v for k, v in t.items() if f".{i}." in k}

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, n, HEADS, DIM // HEADS).transpose(1, 2)

        q, k, v = (
            heads(F.linear(x, p[f"attention.self.{w}.weight"], p[f"attention.self.{w}.bias"]))
            for w in ("query", "key", "value")
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, DIM)
        attended = F.layer_norm(
            F.linear(context, p["attention.output.dense.weight"], p["attention.output.dense.bias"])
            + x,
            (DIM,),
            p["attention.output.LayerNorm.weight"],
            p["attention.output.LayerNorm.bias"],
            1e-12,
        )
        inner = F.gelu(
            F.linear(attended, p["intermediate.dense.weight"], p["intermediate.dense.bias"])
        )
        x = F.layer_norm(
            F.linear(inner, p["output.dense.weight"], p["output.dense.bias"]) + attended,
            (DIM,),
            p["output.LayerNorm.weight"],
            p["output.LayerNorm.bias"],
            1e-12,
        )
    return x


def write_files(folder: Path, *, sharded: bool, offset: float = 0.0) -> str:
    """The weights (one file, or two shards and an index) and the data; returns the
    file the program names. ``offset`` moves the labels off PyTorch's output."""
    tensors = hf_tensors()
    if sharded:
        shards: dict[str, dict[str, torch.Tensor]] = {}
        weight_map = {}
        for name, value in tensors.items():
            shard = f"model-0000{int(name.split('.')[2]) + 1}-of-00002.safetensors"
            shards.setdefault(shard, {})[name] = value
            weight_map[name] = shard
        for shard, part in shards.items():
            save_file(part, str(folder / shard))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        file = "model.safetensors.index.json"
    else:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        file = "model.safetensors"
    x = torch.randn(RECORDS, TIME, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = plain_bert(x, tensors) + offset
    np.save(folder / "features.npy", x.numpy())
    np.save(folder / "labels.npy", y.numpy())
    program = PROGRAM.format(
        layers=LAYERS, records=RECORDS, dim=DIM, heads=HEADS, hidden=HIDDEN, file=file
    )
    (folder / "hf.sx").write_text(program)
    return file


def first_loss(folder: Path) -> float:
    done = run_sexpgpu("run", "hf.sx", "--checkpoint-dir", "ckpt", "--log-every", "1", cwd=folder)
    assert done.returncode == 0, done.stderr
    (events,) = (folder / "sexpgpu-runs").rglob("events.jsonl")
    (loss,) = [
        e["value"]
        for e in map(json.loads, events.read_text().splitlines())
        if e.get("kind") == "point" and e.get("name") == "loss"
    ]
    return loss


@pytest.mark.parametrize("sharded", [False, True], ids=["model.safetensors", "index.json"])
def test_the_sx_encoder_computes_what_plain_pytorch_does(tmp_path: Path, sharded: bool) -> None:
    write_files(tmp_path, sharded=sharded)
    # the mean squared difference over outputs of unit size: float rounding only
    assert first_loss(tmp_path) < 1e-10
    params = experiment(tmp_path / "ckpt" / "step-00000001")["params"]
    pinned = {p["path"]: p["load"] for p in params if "load" in p}
    assert len(pinned) == 16 * LAYERS
    query = pinned["bert.layer.1.attention.self.query.weight"]
    assert query["tensor"] == "encoder.layer.1.attention.self.query.weight"
    # an index is never pinned: the shard that holds the tensor is
    assert query["uri"] == ("model-00002-of-00002.safetensors" if sharded else "model.safetensors")


def test_a_difference_from_pytorch_would_show(tmp_path: Path) -> None:
    write_files(tmp_path, sharded=False, offset=0.01)
    assert first_loss(tmp_path) == pytest.approx(1e-4, rel=1e-3)

"""Third-party plugins written from docs/plugins.md, as a user writes them.

An optimizer's options spelled as the docs spell them (``"weight-decay"``) are set
from a `.sx` file's ``:weight-decay``, and ``propose`` receives the types the docs
say; an op is listed by `sexpgpu plugins` as a `.sx` file writes it, with its options
and their defaults; the storage backend the docs give, copied as it is, holds a run's
checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.e2e.helpers import run_sexpgpu
from tests.foundation.pluginkit import make_plugin, user_env
from tests.foundation.test_public_api import core_violations

LION = '''
"""Lion (sign of an interpolated momentum), a third-party optimizer."""

import json
import os

import torch

from sexpgpu.extension import OptimizerInfo
from sexpgpu.hookspecs import hookimpl


def _kind(value):
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return "list of " + ",".join(sorted({_kind(v) for v in value}))
    if isinstance(value, dict):
        return "dict of " + ",".join(sorted({_kind(v) for v in value.values()}))
    return type(value).__name__


class LionUpdate:
    def init_states(self, params, options):
        return {"m": [torch.zeros_like(p, dtype=torch.float32) for p in params]}

    def propose(self, params, grads, states, *, lr, count, options, decay):
        seen = {
            "params": _kind(params), "grads": _kind(grads), "states": _kind(states),
            "lr": _kind(lr), "count": _kind(count), "decay": _kind(list(decay)),
            "options": dict(options),
        }
        with open(os.environ["LION_SEEN"], "a") as handle:
            handle.write(json.dumps(seen) + "\\n")
        b1, b2, wd = options["beta1"], options["beta2"], options["weight-decay"]
        new_params, new_m = [], []
        for p, g, m, d in zip(params, grads, states["m"], decay):
            g32, p32 = g.float(), p.float()
            if d and wd:
                p32 = p32 * (1 - lr * wd)
            new_params.append((p32 - lr * torch.sign(b1 * m + (1 - b1) * g32)).to(p.dtype))
            new_m.append(b2 * m + (1 - b2) * g32)
        return new_params, {"m": new_m}


@hookimpl
def sexpgpu_optimizers():
    return [
        OptimizerInfo(
            name="lion",
            options={"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight-decay": 0.0},
            state_names=lambda options: ("m",),
            factory=LionUpdate,
            doc="Lion: the sign of an interpolated momentum",
        )
    ]
'''

PROGRAM = """
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 3) :seq 16 :batch 4)
(defrun lion-run
  :model (net 32 8)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (lion :lr 0.001 :weight-decay 0.1)
  :steps 2
  :seed 1)
"""


def test_an_optimizer_s_options_are_set_as_written_and_propose_gets_the_documented_types(
    tmp_path: Path,
) -> None:
    plugin = make_plugin(
        tmp_path / "plugin", "sexpgpu-lion", {"lion_opt": LION}, {"lion": "lion_opt"}
    )
    (tmp_path / "lion.sx").write_text(PROGRAM)
    seen_file = tmp_path / "seen.jsonl"
    env = user_env([plugin], LION_SEEN=str(seen_file))
    done = run_sexpgpu("run", "lion.sx", "--metrics-dir", "m", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    seen = [json.loads(line) for line in seen_file.read_text().splitlines()]
    assert len(seen) == 2  # one proposal a step
    assert seen[0] == {
        "params": "list of tensor",
        "grads": "list of tensor",
        "states": "dict of list of tensor",
        "lr": "float",
        "count": "int",
        "decay": "list of bool",
        "options": {"lr": 0.001, "beta1": 0.9, "beta2": 0.99, "weight-decay": 0.1},
    }


LEAKY = '''
"""leaky_relu, a third-party op with one option."""

from sexpgpu.extension import OpInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.lang.ops import Arg, Keyword, OpSpec, same_float

SPEC = OpSpec(
    "leaky_relu",
    "x, or slope * x where x < 0",
    same_float,
    (Arg("x"),),
    (Keyword("slope", "number", 0.01), Keyword("scale", "number", example=":scale 1.0")),
)


def torch_leaky(attrs):
    import torch.nn.functional as F

    return lambda x: F.leaky_relu(x, attrs["slope"]) * attrs["scale"]


@hookimpl
def sexpgpu_ops():
    return [OpInfo("leaky_relu", SPEC, {"torch": lambda: torch_leaky}, SPEC.doc)]
'''


def test_an_op_is_listed_as_a_file_writes_it_with_its_options(tmp_path: Path) -> None:
    plugin = make_plugin(
        tmp_path / "plugin", "sexpgpu-leaky", {"leaky_op": LEAKY}, {"leaky": "leaky_op"}
    )
    env = user_env([plugin])
    listed = run_sexpgpu("plugins", cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    (line,) = [
        line.strip() for line in listed.stdout.splitlines() if "leaky" in line and "op " in line
    ]
    assert line == (
        "op leaky-relu (scale required; slope=0.01; implemented for torch): "
        "x, or slope * x where x < 0"
    ), line
    described = run_sexpgpu("plugins", "--json", cwd=tmp_path, env=env)
    (plugin_entry,) = [p for p in json.loads(described.stdout) if p["name"] == "leaky"]
    (op,) = plugin_entry["supplies"]["ops"]
    assert (op["name"], op["written"], op["required"], op["options"]) == (
        "leaky_relu",
        ["leaky-relu"],
        ["scale"],
        {"slope": 0.01},
    )


def _storage_example() -> str:
    """The storage backend docs/plugins.md gives, as a reader copies it."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    section = text.split("\n## sexpgpu_storage_backends\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    return block


def test_the_storage_backend_docs_plugins_md_gives_checkpoints_and_resumes(
    tmp_path: Path,
) -> None:
    """docs/plugins.md says enough to write a storage backend without the source: its
    example, copied as it is, holds a run's checkpoints, which a resume finds."""
    example = _storage_example()
    assert core_violations(example, "mem_store.py") == []  # the public API alone
    plugin = make_plugin(
        tmp_path / "plugin", "sexpgpu-mem", {"mem_store": example}, {"mem": "mem_store"}
    )
    program = PROGRAM.replace("(lion :lr 0.001 :weight-decay 0.1)", "(adam :lr 0.001)")
    program = "(defknob steps 2)\n" + program.replace(":steps 2", ":steps steps")
    (tmp_path / "adam.sx").write_text(program.replace(":seed 1", ":seed 1 :checkpoint-every 1"))
    env = user_env([plugin], MEM_ROOT=str(tmp_path / "store"))
    args = ["adam.sx", "--metrics-dir", "m", "--checkpoint-dir", "mem://bucket/run"]
    first = run_sexpgpu("run", *args, "--steps", "1", cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    resumed = run_sexpgpu("run", *args, "--resume", "latest", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert '"event": "run resumed"' in resumed.stderr
    stored = tmp_path / "store" / "bucket" / "run"
    assert sorted(p.name for p in stored.iterdir()) == ["step-00000001", "step-00000002"]

"""Programs drawn across what can move a resume's bits, and the check that a resume
from every checkpoint equals the uninterrupted run, byte for byte, and that every
eval pass, in the run, in a resumed run and in `sexpgpu evaluate`, reports the
same numbers to the bit.

Used by ``test_drawn_programs.py`` (a few programs per CI run) and by
``scripts/sweep_resume.py`` (the whole sweep). A program is drawn from a seed, so
a failing one is made again from the seed its test id or the sweep names.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sexpgpu_torch.recompiles import RECOMPILED
from tests.profiles import PROFILES

STEPS = 4
"""Steps of every drawn program, a checkpoint after each: resumes from steps 1, 2, 3."""
FILES = ("params.safetensors", "states.safetensors")
EVAL_EVERY = 2
"""Every drawn program has an eval pass, ``probe``, after steps 2 and 4."""


@dataclass(frozen=True)
class Drawn:
    """One drawn program: its source and what was drawn."""

    seed: int
    source: str
    features: Mapping[str, str]
    choose: tuple[str, ...]
    """``--choose`` requests the program's lowering takes (``stack=recompute``)."""
    profile: str = "one-thread"
    """The machine profile its processes start with (``tests.profiles.PROFILES``)."""
    devices: int = 1
    """``--devices``: ranks on this machine (the program says how they shard)."""
    files: Mapping[str, bytes] = field(default_factory=dict)
    """Data files the program reads, by name in its folder."""

    def name(self) -> str:
        return f"seed{self.seed}-" + "-".join(f"{k}={v}" for k, v in self.features.items())

    def args(self) -> list[str]:
        """What every `sexpgpu run` of this program adds: its kernels and its ranks."""
        asked = [a for c in self.choose for a in ("--choose", c)]
        return [*asked, *(["--devices", str(self.devices)] if self.devices > 1 else [])]


TOKENS = "tokens.bin"
"""A drawn second stage's own data: a token file (another source, another batch shape)."""


def _token_file(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 16, 400, dtype=np.uint16).tobytes()


_OPTIMIZERS = {
    "sgd": "(sgd :lr 0.05 :momentum 0.9{wd})",
    "nesterov": "(sgd :lr 0.05 :momentum 0.9 :nesterov true{wd})",
    "adam": "(adam :lr 0.01{wd})",
    "adamw": "(adamw :lr 0.01{wd} :no-decay-tags (no-decay))",
}
_SCHEDULES = {
    "constant": "",
    "warmup": " :schedule (warmup :warmup 2)",
    "cosine": " :schedule (cosine :warmup 1 :min-lr 0.001)",
}


_LOSSES = {
    "ce": "(cross-entropy (model inputs) targets)",
    # a policy gradient: each record's summed log-probability of the targets, weighted by
    # its reward (the positions it gets right) normalised within groups of 4 records
    "pg": """(let [logits (model inputs)
              picked (maximum targets 0)
              counted (cast (>= targets 0) f32)
              seq (sum (* (gather (log-softmax logits) picked) counted) :axis 1)
              right (cast (== (argmax (stop-gradient logits)) picked) f32)
              reward (sum (* right counted) :axis 1)
              adv (/ (- reward (group-mean reward :size 4))
                     (+ (group-std reward :size 4) 1e-6))]
          (neg (mean (* (stop-gradient adv) seq))))""",
}
"""The losses a drawn program trains with (``sort``'s records: negative targets masked)."""


_HEADS = {16: 2, 24: 4}
"""Attention heads by width: 8 and 6 wide (with its reproducibility mode off, MKL
multiplied 6-wide heads of 16 positions in another order: issue 49)."""


def _repeat(kind: str, dim: int) -> str:
    """The layer that repeats ``blk`` twice at width ``dim``."""
    heads = f" {_HEADS[dim]}" if kind == "attention" else ""
    return f"  (layer blocks (repeat 2 (blk dim{heads})))"


def _block(kind: str, dropout: float) -> list[str]:
    """The repeated block ``blk``: an MLP with a residual (and dropout), or a transformer
    block (attention, layer norms, an MLP)."""
    if kind == "attention":
        return ["(defmodel blk (dim heads)", "  (layer t (transformer-block dim heads))",
                "  (forward (x) (t x)))"]  # fmt: skip
    residual = f"(dropout (down (gelu (up x))) {dropout})" if dropout else "(down (gelu (up x)))"
    return ["(defmodel blk (dim)", "  (layer up (linear dim 24))", "  (layer down (linear 24 dim))",
            f"  (forward (x) (+ x {residual})))"]  # fmt: skip


def draw(seed: int, *, lowering: str) -> Drawn:
    """A program drawn from ``seed`` for ``lowering`` (``torch`` or ``compiled``)."""
    rng = random.Random(seed)
    optimizer = rng.choice(sorted(_OPTIMIZERS))
    decay = rng.choice([False, True])
    schedule = rng.choice(sorted(_SCHEDULES))
    clip = rng.choice([None, "0.5"])
    guard = rng.choice([False, True])
    dropout = rng.choice([0.0, 0.1])
    precision = rng.choice(["f32", "bf16"])
    stages = rng.choice([1, 2])
    repeat = rng.choice(["none", "plain"] + (["recompute"] if lowering == "compiled" else []))
    frozen = rng.choice([False, True])
    loss = rng.choice(sorted(_LOSSES))  # drawn before what came later: a seed keeps its program
    new_data = rng.choice([False, True])  # for two stages: the second reads a token file
    profile = rng.choice(sorted(PROFILES))
    kind = rng.choice(["mlp", "attention"])
    dim = rng.choice(sorted(_HEADS))
    vocab = rng.choice([16, 17])  # 17: an odd width, a table cut unevenly
    seq = rng.choice([8, 16])

    wd = " :weight-decay 0.01" if decay else ""
    opt = _OPTIMIZERS[optimizer].format(wd=wd)
    opt = opt[:-1] + _SCHEDULES[schedule] + (f" :clip {clip}" if clip else "") + ")"
    body = "(embed ids)"
    if repeat != "none":
        body = f"(-> {body} blocks)"
    body = f"(matmul {body} head)"
    if frozen:
        body = f"(+ {body} bias)"
    if dropout and repeat == "none":
        body = f"(dropout {body} {dropout})"
    layers = [
        "  (layer embed (embedding vocab dim))",
        *([_repeat(kind, dim)] if repeat != "none" else []),
        "  (param head [dim vocab] :init (normal 0.1) :tags (no-decay))",
        *(["  (param bias [vocab] :init (uniform -0.1 0.1) :frozen true)"] if frozen else []),
    ]
    if stages == 1:
        schedule_lines = f"  :optimizer {opt}\n  :steps {STEPS}"
    else:
        first = "(sgd :lr 0.05)" if optimizer != "sgd" else "(adam :lr 0.01)"
        data = " :data other" if new_data else ""
        schedule_lines = (
            f"  :optimizer {opt}\n"
            f"  :stages ((stage warm :steps 2 :optimizer {first})\n"
            f"           (stage main :steps {STEPS - 2}{data}))"
        )
    source = "\n".join(
        [
            *_block(kind, dropout),
            "(defmodel net (vocab dim)",
            *layers,
            f"  (forward (ids) {body}))",
            f"(defdata train (sort :vocab 16) :seq {seq} :batch 8)",
            *(
                [f'(defdata other (tokens :path "{TOKENS}" :dtype "uint16") :seq 6 :batch 12)']
                if stages == 2 and new_data
                else []
            ),
            "(defrun drawn",
            f"  :model (net {vocab} {dim})",
            "  :data train",
            f"  :loss {_LOSSES[loss]}",
            schedule_lines,
            "  :checkpoint-every 1",
            f"  :seed {seed % 1000}",
            f"  :precision {precision}",
            f"  :guard-finite {'true' if guard else 'false'}",
            f"  :evals ((eval probe :every {EVAL_EVERY} :batches 2 :metrics (loss accuracy))))",
            "",
        ]
    )
    features = {
        "opt": optimizer + ("+wd" if decay else ""),
        "sched": schedule,
        "clip": "on" if clip else "off",
        "guard": "on" if guard else "off",
        "dropout": "on" if dropout else "off",
        "prec": precision,
        "stages": str(stages) + ("+data" if stages == 2 and new_data else ""),
        "repeat": repeat + (f"x{kind}" if repeat != "none" else ""),
        "width": f"{dim}x{vocab}x{seq}",
        "frozen": "on" if frozen else "off",
        "loss": loss,
        "profile": profile,
    }
    choose = ("stack=recompute",) if repeat == "recompute" else ()
    files = {TOKENS: _token_file(seed)} if stages == 2 and new_data else {}
    return Drawn(seed, source, features, choose, profile=profile, files=files)


def draw_sharded(seed: int) -> Drawn:
    """A program drawn from ``seed`` for several ranks: 2 or 3 of them, each keeping
    its slice of every parameter (``:shard full``) or of the optimizer states
    (``:shard optimizer``); with or without a repeat (a unit per block), a table whose
    rows split unevenly, and a scalar (FSDP2 shards no scalar); its own profile."""
    rng = random.Random(seed)
    devices = rng.choice([2, 3])
    shard = rng.choice(["full", "optimizer"])
    repeat = rng.choice([False, True])
    vocab = rng.choice([16, 17])
    scalar = rng.choice([False, True])
    optimizer = rng.choice(["adam", "adamw", "sgd"])
    clip = rng.choice([False, True])
    profile = rng.choice(sorted(PROFILES))
    kind = rng.choice(["mlp", "attention"])
    dim = rng.choice(sorted(_HEADS))
    seq = rng.choice([8, 16])
    opt = {
        "adam": "(adam :lr 0.01{clip})",
        "adamw": "(adamw :lr 0.01 :weight-decay 0.01{clip})",
        "sgd": "(sgd :lr 0.05 :momentum 0.9{clip})",
    }[optimizer].format(clip=" :clip 0.5" if clip else "")
    body = "(embed ids)"
    if repeat:
        body = f"(-> {body} blocks)"
    body = f"(matmul {body} head)"
    if scalar:
        body = f"(* gain {body})"
    source = "\n".join(
        [
            *_block(kind, 0.0),
            "(defmodel net (vocab dim)",
            "  (layer embed (embedding vocab dim))",
            *([_repeat(kind, dim)] if repeat else []),
            "  (param head [dim vocab] :init (normal 0.1))",
            *(["  (param gain [] :init (ones))"] if scalar else []),
            f"  (forward (ids) {body}))",
            f"(defdata train (sort :vocab 16) :seq {seq} :batch 12)",
            "(defrun drawn",
            f"  :model (net {vocab} {dim})",
            "  :data train",
            f"  :loss {_LOSSES['ce']}",
            f"  :optimizer {opt}",
            f"  :steps {STEPS}",
            "  :checkpoint-every 1",
            f"  :seed {seed % 1000}",
            f"  :shard {shard}",
            f"  :evals ((eval probe :every {EVAL_EVERY} :batches 3 :metrics (loss accuracy))))",
            "",
        ]
    )
    features = {
        "ranks": str(devices),
        "shard": shard,
        "repeat": kind if repeat else "off",
        "width": f"{dim}x{vocab}x{seq}",
        "scalar": "on" if scalar else "off",
        "opt": optimizer,
        "clip": "on" if clip else "off",
        "profile": profile,
    }
    return Drawn(seed, source, features, (), profile=profile, devices=devices)


Runner = Callable[..., subprocess.CompletedProcess]


def check_resumes(drawn: Drawn, folder: Path, *, lowering: str, run: Runner) -> list[str]:
    """Train ``drawn`` uninterrupted, then resume each of its checkpoints but the last
    in a new process, and evaluate the uninterrupted run's checkpoints with
    `sexpgpu evaluate --follow`; the differences from the uninterrupted run's files and
    eval points, and any graph compiled again after warm-up (none: ``[]``).

    ``run(*args, cwd=folder)`` runs ``sexpgpu ARGS`` in a subprocess."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "drawn.sx").write_text(drawn.source)
    for name, data in drawn.files.items():
        (folder / name).write_bytes(data)
    common = ["--lowering", lowering, *drawn.args()]
    full = run("run", "drawn.sx", "--checkpoint-dir", "full", "--metrics-dir", "m-full",
               *common, cwd=folder)  # fmt: skip
    if full.returncode != 0:
        return [f"the uninterrupted run failed: {full.stderr[-2000:]}"]
    differences = _recompiled("the uninterrupted run", full.stderr)
    passes = eval_points(folder / "m-full")
    if sorted(passes) != list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)):
        differences.append(f"the uninterrupted run's eval passes ran at steps {sorted(passes)}")
    for step in range(1, STEPS):
        name = f"from-{step}"
        step_dir = f"step-{step:08d}"
        (folder / name).mkdir()
        shutil.copytree(folder / "full" / step_dir, folder / name / step_dir)
        resumed = run("run", "drawn.sx", "--checkpoint-dir", name, "--metrics-dir",
                      f"m-{name}", "--resume", "latest", *common, cwd=folder)  # fmt: skip
        if resumed.returncode != 0:
            differences.append(f"resumed from step {step}: failed: {resumed.stderr[-2000:]}")
            continue
        differences += _recompiled(f"resumed from step {step}", resumed.stderr)
        for later in range(step + 1, STEPS + 1):
            for file in FILES:
                path = f"step-{later:08d}/{file}"
                if (folder / name / path).read_bytes() != (folder / "full" / path).read_bytes():
                    differences.append(f"resumed from step {step}: {path} differs")
        later_passes = {s: v for s, v in passes.items() if s > step}
        if eval_points(folder / f"m-{name}") != later_passes:
            differences.append(f"resumed from step {step}: its eval points differ")
    # the recorded lowering, as a user evaluates a finished run
    evaluated = run("evaluate", "full", "--follow", "--poll", "0.1", "--metrics-dir", "m-eval",
                    cwd=folder)  # fmt: skip
    if evaluated.returncode != 0:
        differences.append(f"sexpgpu evaluate failed: {evaluated.stderr[-2000:]}")
    else:
        differences += _recompiled("sexpgpu evaluate", evaluated.stderr)
        if eval_points(folder / "m-eval", source="evaluate") != passes:
            differences.append("sexpgpu evaluate's points differ from the run's own passes")
    return differences


def eval_points(metrics: Path, source: str | None = None) -> dict[int, dict[str, float]]:
    """The eval points of the one experiment under ``metrics``, by step: each metric's
    value as written (``source``: only the points of that source, e.g. ``evaluate``)."""
    points: dict[int, dict[str, float]] = {}
    for events in sorted(metrics.glob("*/events.jsonl")):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            name = event.get("name", "")
            if event.get("kind") != "point" or not name.startswith("probe/"):
                continue
            if source is None or event.get("source") == source:
                points.setdefault(event["step"], {})[name] = event["value"]
    return points


def _recompiled(which: str, stderr: str) -> list[str]:
    """A graph compiled again after warm-up, as the run's log says (none: ``[]``)."""
    return [f"{which}: {line}" for line in stderr.splitlines() if RECOMPILED in line]


def sexpgpu_runner(env: Mapping[str, str], timeout: float = 900) -> Runner:
    """A :data:`Runner` that runs the console entry in a subprocess with ``env``."""

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", "from sexpgpu_cli.main import main; main()", *args],
            cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    return run

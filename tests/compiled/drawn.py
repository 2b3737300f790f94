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
from dataclasses import dataclass
from pathlib import Path

from sexpgpu_torch.recompiles import RECOMPILED

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

    def name(self) -> str:
        return f"seed{self.seed}-" + "-".join(f"{k}={v}" for k, v in self.features.items())


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
    loss = rng.choice(sorted(_LOSSES))  # drawn last: the other draws of a seed stay as they were

    wd = " :weight-decay 0.01" if decay else ""
    opt = _OPTIMIZERS[optimizer].format(wd=wd)
    opt = opt[:-1] + _SCHEDULES[schedule] + (f" :clip {clip}" if clip else "") + ")"
    block = "(+ x (dropout (down (gelu (up x))) {p}))" if dropout else "(+ x (down (gelu (up x))))"
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
        *(["  (layer blocks (repeat 2 (blk dim)))"] if repeat != "none" else []),
        "  (param head [dim vocab] :init (normal 0.1) :tags (no-decay))",
        *(["  (param bias [vocab] :init (uniform -0.1 0.1) :frozen true)"] if frozen else []),
    ]
    if stages == 1:
        schedule_lines = f"  :optimizer {opt}\n  :steps {STEPS}"
    else:
        first = "(sgd :lr 0.05)" if optimizer != "sgd" else "(adam :lr 0.01)"
        schedule_lines = (
            f"  :optimizer {opt}\n"
            f"  :stages ((stage warm :steps 2 :optimizer {first})\n"
            f"           (stage main :steps {STEPS - 2}))"
        )
    source = "\n".join(
        [
            "(defmodel blk (dim)",
            "  (layer up (linear dim 24))",
            "  (layer down (linear 24 dim))",
            f"  (forward (x) {block.format(p=dropout)}))",
            "(defmodel net (vocab dim)",
            *layers,
            f"  (forward (ids) {body}))",
            "(defdata train (sort :vocab 16) :seq 8 :batch 8)",
            "(defrun drawn",
            "  :model (net 16 16)",
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
        "stages": str(stages),
        "repeat": repeat,
        "frozen": "on" if frozen else "off",
        "loss": loss,
    }
    choose = ("stack=recompute",) if repeat == "recompute" else ()
    return Drawn(seed, source, features, choose)


Runner = Callable[..., subprocess.CompletedProcess]


def check_resumes(drawn: Drawn, folder: Path, *, lowering: str, run: Runner) -> list[str]:
    """Train ``drawn`` uninterrupted, then resume each of its checkpoints but the last
    in a new process, and evaluate the uninterrupted run's checkpoints with
    `sexpgpu evaluate --follow`; the differences from the uninterrupted run's files and
    eval points, and any graph compiled again after warm-up (none: ``[]``).

    ``run(*args, cwd=folder)`` runs ``sexpgpu ARGS`` in a subprocess."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "drawn.sx").write_text(drawn.source)
    asked = [a for c in drawn.choose for a in ("--choose", c)]
    common = ["--lowering", lowering, *asked]
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

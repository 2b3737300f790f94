"""Fingerprint what sexpgpu makes, to prove a refactor changed no behaviour.

Trains every example under both lowerings (eager `torch`, `compiled`) with small
settings, then records the sha256 of every checkpoint file, and the text of
`sexpgpu checkpoint`, `sexpgpu check` and `sexpgpu compile --show all` for each.
Run it before and after a change and compare the two JSON files:

    python scripts/fingerprint.py before.json
    python scripts/fingerprint.py after.json --compare before.json

Values that legitimately differ between two runs (the run's slug, which holds a
random part, the time a checkpoint was written, and the temporary paths) are
normalised before hashing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# name -> (file, extra run arguments); small enough to compile cold in a minute.
PROGRAMS = {
    "my-run": ("my-run.sx", ["--steps", "4"]),
    "tiny-lm": ("tiny-lm.sx", ["--steps", "4", "--set", "checkpoint-every=2"]),
    "tiny-lm-wide": ("tiny-lm.sx", ["--steps", "2", "--variant", "wide"]),
    "cnn": ("cnn.sx", ["--steps", "3"]),
    "distill": ("distill.sx", ["--steps", "3"]),
    "gpt2-small": (
        "gpt2-small.sx",
        ["--steps", "2", "--set", "layers=1", "--set", "dim=32", "--set", "heads=2"]
        + ["--set", "context=16", "--set", "batch=2"],
    ),
}
LOWERINGS = ("torch", "compiled")


def _sexpgpu(*args: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "sexpgpu"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"sexpgpu {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def _normalise(text: str, work: Path) -> str:
    text = text.replace(str(work), "<work>")
    return re.sub(r"\b([a-z0-9-]+)-[0-9a-f]{6}\b", r"\1-<slug>", text)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _checkpoint_files(step: Path, work: Path) -> dict[str, str]:
    out = {}
    for path in sorted(step.iterdir()):
        data = path.read_bytes()
        if path.name == "experiment.json":
            record = json.loads(data)
            record.pop("slug", None)
            record.pop("written", None)  # the wall-clock time it was written
            data = _normalise(json.dumps(record, sort_keys=True), work).encode()
        out[path.name] = _sha(data)
    return out


def fingerprint(work: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    examples = work / "examples"
    shutil.copytree(EXAMPLES, examples)
    if not (examples / "teacher.safetensors").exists():
        subprocess.run(
            ["sh", str(examples / "make_teacher.sh")],
            env=dict(env, SEXPGPU=str(Path(sys.executable).parent / "sexpgpu")),
            check=True,
            capture_output=True,
        )
    if not (examples / "gpt2-tokens.bin").exists():
        subprocess.run([sys.executable, str(examples / "make_gpt2_tokens.py")], check=True)
    result: dict[str, str] = {}
    for name, (file, extra) in PROGRAMS.items():
        sx = str(examples / file)
        knobs = list(extra)
        result[f"{name}/check"] = _sha(
            _normalise(_sexpgpu("check", sx, *knobs, cwd=work, env=env), work).encode()
        )
        result[f"{name}/compile"] = _sha(
            _normalise(
                _sexpgpu("compile", sx, "--show", "all", *knobs, cwd=work, env=env), work
            ).encode()
        )
        for lowering in LOWERINGS:
            ckpt = work / "ckpt" / f"{name}-{lowering}"
            _sexpgpu(
                "run",
                sx,
                *extra,
                "--lowering",
                lowering,
                "--checkpoint-dir",
                str(ckpt),
                "--metrics-dir",
                str(work / "metrics"),
                cwd=work,
                env=env,
            )
            for step in sorted(ckpt.glob("step-*")):
                key = f"{name}/{lowering}/{step.name}"
                for fname, digest in _checkpoint_files(step, work).items():
                    result[f"{key}/{fname}"] = digest
                shown = _sexpgpu("checkpoint", str(step), cwd=work, env=env)
                result[f"{key}/sexpgpu-checkpoint"] = _sha(_normalise(shown, work).encode())
            print(f"fingerprint: {name} {lowering}", file=sys.stderr)
    return result


def main() -> int:
    """Write a fingerprint, and compare it with an earlier one when asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--compare", help="an earlier fingerprint to compare against")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = fingerprint(Path(tmp))
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    moved = sorted(k for k in before.keys() | result.keys() if before.get(k) != result.get(k))
    for key in moved:
        print(f"differs: {key}")
    print(f"{len(result)} fingerprints, {len(moved)} differ")
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())

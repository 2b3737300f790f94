"""Damaged and forged checkpoints, each through `sexpgpu run --resume latest` and
`sexpgpu run --resume DIR`, and `sexpgpu checkpoint DIR`, on a local folder: every one
is refused with one line and its code (or, for `sexpgpu checkpoint`, which reads only
headers, shown with its disagreements flagged), never a traceback, never a fresh
start, and nothing is written anywhere. A refused resume trains nothing, so it runs
in this process (tests/inprocess.py, which fails a test whose run gets as far as
lowering); the runs that go on to train are subprocesses.

A forger who edits ``state.json`` and fixes its checksum in ``experiment.json`` too
("forged") meets the checks of the fields themselves; one who does not ("edited")
meets the checksum first.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import pytest

from tests.e2e.helpers import (
    events,
    experiments,
    refused_in_process,
    run_sexpgpu,
    sexpgpu_in_process,
    step_dirs,
)

from .kit import RESUME_RUN as RUN
from .kit import error_line

STEP4 = Path("ckpt/step-00000004")
P, S, T, E = (
    STEP4 / n for n in ("params.safetensors", "states.safetensors", "state.json", "experiment.json")
)
OLDER = "--resume latest never falls back to an older checkpoint: to resume from the one before it, pass --resume ckpt/step-00000002"


# ------------------------------------------------------------------ forging tools


def _crc(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def _json(path: Path, change: Callable[[dict], object]) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def _forge(w: Path, name: Path, change: Callable[[dict], object]) -> None:
    """Edit a JSON file of step 4 and record its new checksum, as a careful forger would."""
    _json(w / name, change)
    data = (w / name).read_bytes()
    _json(
        w / E,
        lambda r: r["files"].update({name.name: {"size": len(data), "crc32c": _crc(data)}}),
    )


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _header(path: Path, change: Callable[[dict], object]) -> None:
    """Rewrite a safetensors header in place, its data untouched."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])


def _swap_offsets(header: dict) -> None:
    a, b = header["model.embed"], header["model.head"]
    a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]


def _deep(levels: int = 100_000) -> str:
    return "[" * levels + "]" * levels


def _deep_header(path: Path) -> None:
    text = ('{"x": ' + _deep() + "}").encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)


def _symlinked_step(w: Path) -> None:
    elsewhere = w / "elsewhere"
    shutil.move(w / STEP4, elsewhere)
    os.symlink(elsewhere, w / STEP4)


def _replace(path: Path, make: Callable[[Path], object]) -> None:
    path.unlink()
    make(path)


# damage -> (spoil, resume's error line after "sexpgpu run: ", what `sexpgpu checkpoint`
# says: None when it shows the checkpoint (it reads headers only), else its error line
# after "sexpgpu checkpoint: ").
DAMAGE: dict[str, tuple[Callable[[Path], object], str, str | None]] = {
    "a flipped byte in params": (
        lambda w: _flip(w / P, -5),
        f"E-CKPT-006: {P} is not the file its checkpoint wrote: its CRC32C is",
        None,
    ),
    "a flipped byte in states": (
        lambda w: _flip(w / S, -5),
        f"E-CKPT-006: {S} is not the file its checkpoint wrote: its CRC32C is",
        None,
    ),
    "two tensors' offsets swapped": (
        lambda w: _header(w / P, _swap_offsets),
        f"E-CKPT-006: {P} is not the file its checkpoint wrote",
        None,
    ),
    "a state relabelled I32": (
        lambda w: _header(w / S, lambda h: h["model.head/m"].update(dtype="I32")),
        f"E-CKPT-002: {S} is damaged: model.head/m is int32, where a state is stored as F32",
        f"E-CKPT-002: {STEP4}: the tensor files disagree with experiment.json (1 problem",
    ),
    "a NUL in a tensor name": (
        lambda w: _header(w / P, lambda h: h.update({"model.embed\x00x": h.pop("model.embed")})),
        f"E-CKPT-003: {P} has a tensor named 'model.embed\\x00x', which is no parameter name",
        # the same code and words as the resume's, then the flagged lines' count
        f"E-CKPT-003: {P} has a tensor named 'model.embed\\x00x', which is no parameter name "
        "(2 problems, flagged with ! above)",
    ),
    "state.json edited": (
        lambda w: _json(w / T, lambda r: r.update(records=3)),
        f"E-CKPT-006: {T} is not the file its checkpoint wrote",
        f"E-CKPT-006: {T} is not the file its checkpoint wrote",
    ),
    "step 2 in step-4": (
        lambda w: _forge(w, T, lambda r: r.update(step=2)),
        f"E-CKPT-002: {T} is damaged: its step is 2, where its folder is the checkpoint of step 4",
        f"E-CKPT-002: {T} is damaged: its step is 2",
    ),
    "step 1000 in step-4": (
        lambda w: _forge(w, T, lambda r: r.update(step=1000)),
        f"E-CKPT-002: {T} is damaged: its step is 1000, where its folder",
        f"E-CKPT-002: {T} is damaged: its step is 1000",
    ),
    "a stage the program lacks": (
        lambda w: _forge(w, T, lambda r: r.update(stage=3)),
        f"E-CKPT-004: {T} is at stage 3, and this program has 1 stage",
        None,
    ),
    "evals_pending a string": (
        lambda w: _forge(w, T, lambda r: r.update(evals_pending="abc")),
        f"E-CKPT-002: {T} is damaged: evals_pending is not array",
        f"E-CKPT-002: {T} is damaged: evals_pending is not array",
    ),
    "an evaluation pass the program lacks": (
        lambda w: _forge(w, T, lambda r: r.update(evals_pending=["nope"])),
        f"E-CKPT-004: {T} owes the evaluation pass 'nope', which this program does not have",
        None,
    ),
    "a loader position beyond any data": (
        lambda w: _forge(w, T, lambda r: r.update(loader={"index": 10**30})),
        f"E-CKPT-002: {T} is damaged: loader/index is not a value sexpgpu writes",
        f"E-CKPT-002: {T} is damaged: loader/index",
    ),
    "knobs an object": (
        lambda w: _json(w / E, lambda r: r.update(knobs={"lr": 1})),
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: knobs is not array",
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: knobs is not array",
    ),
    "a source that is a number": (
        lambda w: _json(w / E, lambda r: r.update(sources=[1])),
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: sources/0 is not object",
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: sources/0 is not object",
    ),
    "a source name that clears the screen": (
        lambda w: _json(w / E, lambda r: r["sources"][1].update(name="\x1b[2J\x1b[Hmy-run.sx")),
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: sources/1/name is not of the form",
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: sources/1/name is not of the form",
    ),
    "a slug that climbs": (
        lambda w: _json(w / E, lambda r: r.update(slug="../../ESCAPED")),
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: slug is not of the form sexpgpu writes",
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: slug is not of the form",
    ),
    "an absolute slug": (
        lambda w: _json(w / E, lambda r: r.update(slug=str(w / "ESCAPED-abcdef"))),
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: slug is not of the form sexpgpu writes",
        f"E-CKPT-003: {E} is not a sexpgpu checkpoint's: slug is not of the form",
    ),
    "state.json nested 100000 deep": (
        lambda w: (w / T).write_text(_deep()),
        f"E-CKPT-007: {T} is damaged: its JSON is nested deeper than 32 levels",
        f"E-CKPT-007: {T} is damaged: its JSON is nested deeper than 32 levels",
    ),
    "experiment.json nested 100000 deep": (
        lambda w: (w / E).write_text('{"format": 1, "params": ' + _deep() + "}"),
        f"E-CKPT-007: {E} is damaged: its JSON is nested deeper than 32 levels",
        f"E-CKPT-007: {E} is damaged: its JSON is nested deeper than 32 levels",
    ),
    "a safetensors header nested 100000 deep": (
        lambda w: _deep_header(w / P),
        f"E-CKPT-007: {P} is damaged: its JSON is nested deeper than 32 levels",
        f"E-CKPT-007: {P} is damaged: its JSON is nested deeper than 32 levels",
    ),
    "a symlinked step folder": (
        _symlinked_step,
        f"E-STORAGE-007: {STEP4} is a symbolic link; a checkpoint location holds only real",
        f"E-STORAGE-007: {STEP4} is a symbolic link",
    ),
    "params.safetensors is /dev/zero": (
        lambda w: _replace(w / P, lambda p: os.symlink("/dev/zero", p)),
        f"E-STORAGE-007: {P} is a symbolic link",
        f"E-STORAGE-007: {P} is a symbolic link",
    ),
    "params.safetensors is a FIFO": (
        lambda w: _replace(w / P, os.mkfifo),
        f"E-STORAGE-007: {P} is not a regular file",
        f"E-STORAGE-007: {P} is not a regular file",
    ),
}


def _snapshot(workdir: Path) -> dict[str, bytes | str]:
    """Every entry under the work folder (files by content, links by target), but FIFOs."""
    found: dict[str, bytes | str] = {}
    for path in sorted(workdir.rglob("*")):
        name = str(path.relative_to(workdir))
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        elif path.is_file():
            found[name] = path.read_bytes()
        elif not path.is_dir():
            found[name] = "special"
    return found


@pytest.mark.parametrize("resume", ["latest", str(STEP4)])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_resume_from_a_damaged_checkpoint_is_refused_and_writes_nothing(workdir, damage, resume):
    spoil, expected, _ = DAMAGE[damage]
    spoil(workdir)
    before = _snapshot(workdir)
    line = error_line(refused_in_process(*RUN, "--resume", resume, cwd=workdir))
    assert line.startswith(f"sexpgpu run: {expected}"), line
    # latest names the checkpoint before the damaged one, unless the damage is that the
    # program cannot continue it (no older one can either) or step-4 cannot be listed.
    if resume == "latest" and "E-CKPT-004" not in expected and "symlinked" not in damage:
        assert line.endswith(OLDER), line
    assert "\x1b" not in line
    # Not a fresh start, and nothing written anywhere: not in the checkpoint location,
    # not in the metrics folder, not outside it.
    assert _snapshot(workdir) == before
    (run_dir,) = experiments(workdir / "m")
    assert max(e["step"] for e in events(run_dir) if e.get("name") == "loss") == 4


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_sexpgpu_checkpoint_refuses_or_flags_a_damaged_checkpoint(workdir, damage):
    spoil, _, expected = DAMAGE[damage]
    spoil(workdir)
    done = sexpgpu_in_process("checkpoint", str(STEP4), cwd=workdir)
    assert "Traceback" not in done.stderr
    assert "\x1b" not in done.stdout + done.stderr
    if expected is None:  # the damage is in bytes `checkpoint` does not read
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"checkpoint {STEP4}\nstep       4\n"), done.stdout
        return
    if "problem" in expected:  # the description, its flagged lines, then the error
        assert done.returncode == 1, done.stderr
        assert done.stdout.startswith(f"checkpoint {STEP4}\n") and "\n! " in done.stdout
        (line,) = done.stderr.splitlines()
    else:
        line = error_line(done)
    assert line.startswith(f"sexpgpu checkpoint: {expected}"), done.stderr


def test_flagged_lines_are_escaped_and_name_each_disagreement(workdir):
    _header(workdir / P, lambda h: h.update({"\x1b[2Jmodel.x\nforged": h.pop("model.embed")}))
    done = sexpgpu_in_process("checkpoint", str(STEP4), cwd=workdir)
    assert done.returncode == 1
    assert "\x1b" not in done.stdout and "\nforged" not in done.stdout
    flagged = [line for line in done.stdout.splitlines() if line.startswith("!")]
    assert flagged == [
        "! params.safetensors: model.embed is missing",
        "! params.safetensors: \\x1b[2Jmodel.x\\nforged is not in experiment.json",
    ]
    assert "  \\x1b[2Jmodel.x\\nforged  F32  [32, 8]" in done.stdout


def test_the_newest_checkpoint_damaged_with_none_before_it(workdir):
    shutil.rmtree(workdir / "ckpt" / "step-00000002")
    _flip(workdir / P, -5)
    line = error_line(refused_in_process(*RUN, "--resume", "latest", cwd=workdir))
    assert line.startswith(f"sexpgpu run: E-CKPT-006: {P} is not the file"), line
    assert line.endswith(
        "there is no complete checkpoint before it (move it aside to start afresh)"
    )


def test_nothing_is_written_through_a_symlinked_step_folder(workdir):
    # The step a resume writes next is a link to another folder: refused, not written through.
    target = workdir / "other"
    target.mkdir()
    os.symlink(target, workdir / "ckpt" / "step-00000006")
    done = run_sexpgpu(*RUN, "--resume", "ckpt/step-00000002", cwd=workdir, timeout=120)
    assert error_line(done).startswith(
        "sexpgpu run: step 6: E-STORAGE-007: ckpt/step-00000006 is a symbolic link"
    ), done.stderr
    assert list(target.iterdir()) == []


def test_a_checkpoint_without_checksums_still_resumes(workdir):
    # Checkpoints written before checksums have no "files": read as before.
    _json(workdir / E, lambda r: r.pop("files"))
    done = run_sexpgpu(*RUN, "--resume", "latest", cwd=workdir, timeout=120)
    assert done.returncode == 0, done.stderr
    assert step_dirs(workdir / "ckpt")[-1] == "step-00000006"


def test_leftovers_of_a_cut_off_write_are_removed_by_the_next_checkpoint(workdir):
    # A run killed while writing step 5 left its folder without experiment.json and
    # temporary files beside it and in step 4; the resume's first checkpoint removes them.
    ckpt = workdir / "ckpt"
    (ckpt / "step-00000005").mkdir()
    (ckpt / "step-00000005" / "params.safetensors").write_bytes(b"cut off" * 100)
    (ckpt / "step-00000005" / ".sexpgpu-tmp-states.safetensors-0badcafe").write_bytes(b"x")
    (ckpt / "step-00000004" / ".sexpgpu-tmp-params.safetensors-0badcafe").write_bytes(b"x")
    listed = sexpgpu_in_process("checkpoint", "ckpt", cwd=workdir)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:2] for line in listed.stdout.splitlines()[2:]] == [
        ["2", "yes"],
        ["4", "yes"],
        ["5", "no"],
    ]

    done = run_sexpgpu(*RUN, "--resume", "latest", cwd=workdir, timeout=120)
    assert done.returncode == 0, done.stderr
    assert step_dirs(ckpt) == ["step-00000002", "step-00000004", "step-00000006"]
    for folder in step_dirs(ckpt):
        assert sorted(os.listdir(ckpt / folder)) == sorted(
            ["experiment.json", "params.safetensors", "state.json", "states.safetensors"]
        ), folder

"""The checkpoint package: one concern per module without cycles, the data
``sexpgpu checkpoint`` is made from, and the layout contract a lowering's export uses."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from sexpgpu import checkpoint as ckpt
from sexpgpu.checkpoint import (
    CheckpointDescription,
    KnobRecord,
    LoadRecord,
    SourceRecord,
    TensorFile,
    TensorHeader,
)
from sexpgpu.errors import CheckpointError
from sexpgpu.lang.ir import LoadSpec
from sexpgpu_cli.commands.checkpoint import render_checkpoint

from .helpers import make_program, param, write

PACKAGE = Path(ckpt.__file__).parent


def _package_imports(path: Path) -> set[str]:
    """The modules of the package that ``path`` imports (absolutely or relatively)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = "sexpgpu.checkpoint." + module if module else "sexpgpu.checkpoint"
            if module.startswith("sexpgpu.checkpoint."):
                found.add(module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found |= {
                a.name.rsplit(".", 1)[1]
                for a in node.names
                if a.name.startswith("sexpgpu.checkpoint.")
            }
    return found


def test_the_modules_import_each_other_without_a_cycle():
    graph = {
        path.stem: _package_imports(path)
        for path in PACKAGE.glob("*.py")
        if path.stem != "__init__"
    }
    assert {"keys", "records", "format", "write", "find", "read", "resume", "describe"} <= set(
        graph
    )
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle: " + " -> ".join((*path, module))
        if module not in done:
            for other in sorted(graph[module]):
                visit(other, (*path, module))
            done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_every_public_name_is_documented():
    for name in ckpt.__all__:
        value = getattr(ckpt, name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"sexpgpu.checkpoint.{name} has no docstring"


def test_layout_tensors_meets_the_contract_an_export_relies_on():
    specs = {"w": ((4, 3), ">f4"), "b": ((3,), "float16"), "n": ((), "int64"), "z": ((0, 2), "u1")}
    arrays = ckpt.layout_tensors(specs)
    assert list(arrays) == list(specs)
    for name, (shape, dtype) in specs.items():
        array = arrays[name]
        assert array.shape == shape and array.dtype == np.dtype(dtype).newbyteorder("<")
        assert array.flags.c_contiguous and array.flags.writeable and not array.any()
    arrays["w"][...] = np.arange(12).reshape(4, 3)
    arrays["n"][...] = -3
    expected = st_save({name: array.copy() for name, array in arrays.items()})
    assert bytes(ckpt.encode_safetensors(arrays)) == expected
    # Some of the names only: still the right file, made by copying.
    some = {name: arrays[name] for name in ("w", "b")}
    assert bytes(ckpt.encode_safetensors(some)) == st_save({k: v.copy() for k, v in some.items()})
    with pytest.raises(CheckpointError, match=r"^c: cannot store a complex64 tensor"):
        ckpt.layout_tensors({"c": ((2,), "complex64")})


def test_describe_checkpoint_returns_the_data_the_cli_lays_out(storage, location):
    teacher = LoadSpec("teacher.safetensors", "teacher.w")
    program = make_program(
        params=(
            *make_program().params,
            param("teacher.w", (4,), trainable=False, tags=("t",), load=teacher),
        )
    )
    write(storage, program, 6)
    description = ckpt.describe_checkpoint(storage, "step-00000006")
    assert description.location == f"{location}/step-00000006"
    assert (description.step, description.devices, description.nodes) == (6, 1, 1)
    assert description.knobs[0] == KnobRecord("lr", 0.5, "default")
    assert description.loaded == (
        LoadRecord("teacher.w", "teacher.w", "teacher.safetensors", 16, "sha256:" + "a" * 64),
    )
    params, states = description.files
    assert (params.name, states.name) == ("params.safetensors", "states.safetensors")
    assert params.tensors[1] == TensorHeader("model.head", "F32", (8, 32), False, ("no-decay",))
    assert params.tensors[2] == TensorHeader("model.noise", "F32", (8,), True, ())
    assert [t.name for t in states.tensors] == [
        "model.embed/m",
        "model.embed/v",
        "model.head/m",
        "model.head/v",
    ]


def test_the_cli_lays_out_a_description():
    description = CheckpointDescription(
        location="s3://b/run/step-00000012",
        step=12,
        sexpgpu="0.2.0",
        variant="small",
        devices=8,
        nodes=2,
        precision="bf16",
        seed=3,
        counters=(),
        sources=(SourceRecord("a.sx", "ab" * 32),),
        slug="run-00000a",
        finished=False,
        knobs=(KnobRecord("sizes", [2, True, None], "--set"), KnobRecord("lr", 0.1, "default")),
        choices=(),
        loaded=(
            LoadRecord("enc.w", "w", "s3://b/w.safetensors", 40, "sha256:0123456789abcdef"),
            LoadRecord("enc.b", "b", "s3://b/w.safetensors", None, "v7"),
        ),
        files=(
            TensorFile("params.safetensors", (TensorHeader("x", "F32", (), True, ("a", "b")),)),
            TensorFile("states.safetensors", ()),
        ),
    )
    assert render_checkpoint(description) == (
        "checkpoint s3://b/run/step-00000012\n"
        "step       12\n"
        "sexpgpu    0.2.0\n"
        "variant    small\n"
        "devices    8 on 2 nodes\n"
        "precision  bf16\n"
        "seed       3\n"
        "counters   -\n"
        "sources\n"
        f"  a.sx                      {'ab' * 32}\n"
        "slug       run-00000a\n"
        "finished   false\n"
        "knobs\n"
        "  sizes  [2 true -]  --set\n"
        "  lr     0.1         default\n"
        "choices\n"
        "loaded\n"
        "  enc.w  w in s3://b/w.safetensors, 40 bytes, sha256:01234567...\n"
        "  enc.b  b in s3://b/w.safetensors, v7\n"
        "params.safetensors  1 tensor\n"
        "  x  F32  []  frozen  a, b\n"
        "states.safetensors  0 tensors\n"
    )

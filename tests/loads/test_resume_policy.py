"""The resume policy for :load files: E-LOAD-001 exactly as the spec writes it, and
the same bytes at another path recorded as a `load` line."""

from __future__ import annotations

import pytest

from sexpgpu.checkpoint import compare_loads
from sexpgpu.errors import CheckpointError

# The spec's example entry (What a checkpoint holds), with the tensor name of its
# E-LOAD-001 example.
URI = "s3://my-bucket/llama/model-00001-of-00002.safetensors"
PINNED = {
    "uri": URI,
    "tensor": "q_proj.weight",
    "size": 4976698672,
    "version": '"9b2cf535f27731c974343645a3985328-149"',
}
RECORDED = {
    "params": [
        {"path": "model.embed", "shape": [32, 8], "dtype": "f32", "trainable": True, "tags": []},
        {
            "path": "model.teacher.q",
            "shape": [4096, 4096],
            "dtype": "f32",
            "trainable": False,
            "tags": [],
            "load": PINNED,
        },
    ]
}


def test_another_etag_is_refused_with_the_specs_message() -> None:
    found = {"model.teacher.q": {**PINNED, "version": '"0cc175b9c0f1b6a831c399e269772661-149"'}}
    with pytest.raises(CheckpointError) as caught:
        compare_loads(RECORDED, found)
    assert caught.value.render() == (
        "E-LOAD-001: a loaded parameter's file is not the one the checkpoint's run read:\n"
        '  model.teacher.q: q_proj.weight in s3://my-bucket/llama/model-00001-of-00002.safetensors, 4976698672 bytes, "9b2cf535f27731c974343645a3985328-149"'
        ' -> q_proj.weight in s3://my-bucket/llama/model-00001-of-00002.safetensors, 4976698672 bytes, "0cc175b9c0f1b6a831c399e269772661-149"\n'
        "restore that file, or start the run again"
    )


@pytest.mark.parametrize(
    "change",
    [{"size": 4976698673}, {"tensor": "k_proj.weight"}, {"version": "sha256:00"}],
)
def test_other_size_version_or_tensor_is_refused(change: dict) -> None:
    with pytest.raises(CheckpointError) as caught:
        compare_loads(RECORDED, {"model.teacher.q": {**PINNED, **change}})
    assert caught.value.code == "E-LOAD-001"
    assert len(caught.value.message.splitlines()) == 3


def test_a_parameter_no_longer_read_from_a_file_is_refused() -> None:
    with pytest.raises(CheckpointError) as caught:
        compare_loads(RECORDED, {})
    assert "model.teacher.q: q_proj.weight in" in caught.value.message
    assert "-> not read from a file" in caught.value.message


def test_the_same_bytes_at_another_path_are_recorded() -> None:
    moved = {**PINNED, "uri": "/mnt/bundle/model-00001-of-00002.safetensors"}
    assert compare_loads(RECORDED, {"model.teacher.q": moved}) == [
        f"load model.teacher.q {URI} -> /mnt/bundle/model-00001-of-00002.safetensors"
    ]
    assert compare_loads(RECORDED, {"model.teacher.q": PINNED}) == []

"""``:load`` locations are opened by the storage backends: any scheme an available
backend plugin serves is accepted, others are one positioned line naming the
schemes there are."""

from __future__ import annotations

import pytest
from lang_helpers import BASE, RUN, program

from sexpgpu.errors import SourceError
from tests.foundation.pluginkit import make_mem_plugin, run_sexpgpu


def _with_load(uri: str) -> str:
    return BASE.replace(
        "(param head [dim vocab] :init (normal 0.02))",
        f'(param head [dim vocab] :load (file "{uri}" "lm_head.weight"))',
    )


@pytest.mark.parametrize(
    "uri", ["gs://b/w.safetensors", "s3://b/w.safetensors.index.json", "file:///w.safetensors"]
)
def test_schemes_of_the_installed_backends_are_accepted(uri):
    p = program(_with_load(uri), run=RUN)
    (head,) = [x for x in p.params if x.path == "model.head"]
    assert head.load is not None and head.load.uri == uri


def test_an_unknown_scheme_names_the_schemes_there_are():
    with pytest.raises(SourceError) as info:
        program(_with_load("hdfs://nn/w.safetensors"), run=RUN)
    assert str(info.value) == (
        "t.sx:6:39: a :load file's scheme 'hdfs' has no storage backend here; schemes: file, gs, s3"
    )


CHECK = """
(defmodel net ()
  (param w [16 4] :load (file "URI" "w"))
  (forward (x) (take w x)))
(defdata d (arithmetic) :seq 16 :batch 2)
(defrun r :model (net) :data d :loss (mean (model inputs)) :optimizer (sgd :lr 0.1) :steps 1)
"""


def test_a_third_party_scheme_is_accepted_and_a_disabled_one_refused(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    plugins = make_mem_plugin(tmp_path / "plugins")
    (tmp_path / "r.sx").write_text(CHECK.replace("URI", "mem://box/w.safetensors"))
    # check reads the file's header, through the third party's plugin
    (tmp_path / "mem" / "box").mkdir(parents=True)
    save_file({"w": np.zeros((16, 4), np.float32)}, str(tmp_path / "mem" / "box" / "w.safetensors"))
    root = str(tmp_path / "mem")
    ok = run_sexpgpu(["check", "r.sx"], cwd=tmp_path, pythonpath=[plugins], MEM_PLUGIN_ROOT=root)
    assert ok.returncode == 0, ok.stderr
    assert "model.w" in ok.stdout
    gone = run_sexpgpu(
        ["check", "r.sx"],
        cwd=tmp_path,
        pythonpath=[plugins],
        SEXPGPU_DISABLE_PLUGINS="mem",
        MEM_PLUGIN_ROOT=root,
    )
    assert gone.returncode == 1
    assert gone.stderr.strip().splitlines()[-1] == (
        "r.sx:3:31: a :load file's scheme 'mem' has no storage backend here; schemes: file, gs, s3"
    )

"""Every value the checkpoint writer can put in ``experiment.json`` is one its reader
takes back, the same (issue 24, item 21: ``--set lr=1e20`` wrote a checkpoint its own
resume refused as a forgery)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from hypothesis import example, given
from hypothesis import strategies as st

from sexpgpu import checkpoint as ckpt
from sexpgpu.lang.ir import Knob
from tests.catalogs import open_location
from tests.properties import budget

from .helpers import make_program, tensors_for

_EDGE_FLOATS = st.sampled_from(
    [1e20, 1e19, 1e18, -1e300, 5e-324, -0.0, 0.0, 1.7976931348623157e308]
)
_SCALARS = (
    _EDGE_FLOATS
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.booleans()
    | st.text(max_size=300)
    | st.text(alphabet=st.characters(codec="utf-8"), min_size=1000, max_size=5000)
)
KNOB_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3), max_leaves=6)


def _same(a: object, b: object) -> bool:
    """Equal as JSON, -0.0 told from 0.0 and 1e20 from 10**20."""
    return json.dumps(a) == json.dumps(b)


@given(value=KNOB_VALUES, choice=st.text(min_size=1, max_size=100))
@example(value=1e20, choice="AUTO")  # refused before: JSON Schema takes 1e20 for an int
@example(value=10**30, choice="AUTO")  # `--set n=1000000000000000000000000000000`
@example(value=-0.0, choice="\x1b[31m")
@budget(40)
def test_what_the_writer_writes_the_reader_takes_back(tmp_path_factory, value, choice) -> None:
    storage = open_location(str(tmp_path_factory.mktemp("round-trip") / "my-run"))
    program = make_program()
    knob = Knob("lr", value, value, "set")
    program = replace(program, knobs=(knob, *program.knobs[1:]))
    params, states = tensors_for(program, 0)
    experiment = ckpt.experiment_record(
        program, choices={"cpu.blas": choice}, slug="my-run-3f9a1c", devices=1, nodes=1,
        finished=False,
    )  # fmt: skip
    state = ckpt.state_record(step=1, stage=0, records=1, counters={}, loader=None, seed=7)
    key = ckpt.write_checkpoint(storage, 1, params, {}, state, experiment)
    loaded = ckpt.load_checkpoint(storage, key)
    (back,) = [k["value"] for k in loaded.experiment["knobs"] if k["name"] == "lr"]
    assert _same(back, experiment["knobs"][0]["value"])
    if isinstance(value, float):
        assert math.copysign(1.0, back) == math.copysign(1.0, value) and back == value
    assert loaded.experiment["choices"]["cpu.blas"] == choice

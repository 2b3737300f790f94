"""The finite guard at the step loop, in this process: a refused step leaves the
trainer's parameters and optimizer states byte for byte as they were before it,
under both torch lowerings.

The subprocess tests cannot see a step committed before the guard looks at it: the
run fails without writing anything afterwards. Here the trainer is still in hand
once the run has failed, so its tensors can be compared with what they were."""

from __future__ import annotations

import numpy as np
import pytest

from sexpgpu.session import Selection, Session, Target
from sexpgpu.train import RunOptions, run
from tests.catalogs import project, tiny_program

# Tiny, so that the compiled lowering compiles it in seconds: two good Adam steps
# (their states are no longer zeros), then a third the test makes overflow.
PROGRAM = tiny_program("guarded", guard_finite=True)
REFUSED = 3
OVERFLOWING_LR = 1e39  # an Adam step of about lr per value: infinite in f32


def tensor_bytes(trainer) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every parameter and optimizer state as the trainer exports it: dtype, shape, bytes."""
    params, states = trainer.export()
    exported = {f"param {k}": v for k, v in params.items()}
    exported.update({f"state {k}": v for k, v in states.items()})
    return {
        k: (str(v.dtype), tuple(v.shape), np.ascontiguousarray(v).tobytes())
        for k, v in exported.items()
    }


@pytest.mark.parametrize(
    "lowering",
    # compiling, even this program, takes some 20 s on 2 cores with the caches cold
    ["torch", pytest.param("compiled", marks=pytest.mark.slow)],
)
def test_a_refused_step_leaves_parameters_and_states_byte_identical(
    lowering, request, tmp_path, monkeypatch
):
    if lowering == "compiled":
        request.getfixturevalue("compile_quietly")
    (tmp_path / "guarded.sx").write_text(PROGRAM)
    before: dict[int, dict] = {}
    lowered = []
    lower = Session.lower

    def lower_and_watch(session, device):
        trainer = lower(session, device)
        propose = trainer.propose

        def propose_and_remember(batch, *, stage, step, lr):
            # what the trainer holds as the loop asks for this step
            before[step] = tensor_bytes(trainer)
            if step == REFUSED:
                lr = OVERFLOWING_LR
            return propose(batch, stage=stage, step=step, lr=lr)

        trainer.propose = propose_and_remember
        lowered.append((session, trainer))
        return trainer

    monkeypatch.setattr(Session, "lower", lower_and_watch)
    options = RunOptions(
        Selection(str(tmp_path / "guarded.sx")),
        Target(lowering=lowering),
        metrics_dir=str(tmp_path / "m"),
    )
    outcome = run(options, project())

    assert (outcome.exit_code, outcome.step) == (1, REFUSED - 1), outcome.message
    assert outcome.message.startswith(f"step {REFUSED}: the proposed ")
    assert outcome.message.endswith("not finite; nothing was committed")
    ((session, trainer),) = lowered
    assert session.made["lowering"] == lowering
    # the steps before it were committed: the states are Adam's, and they moved
    assert before[REFUSED] != before[REFUSED - 1]
    assert any(k.startswith("state ") for k in before[REFUSED])
    after = tensor_bytes(trainer)
    changed = sorted(k for k in before[REFUSED] if after.get(k) != before[REFUSED][k])
    assert after.keys() == before[REFUSED].keys()
    assert changed == [], f"the refused step {REFUSED} changed {changed}"

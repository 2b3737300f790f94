"""A compiled graph that compiles again after its first call is said once in the log.

In this process, on torch's ``eager`` backend (dynamo's guards without inductor's
code generation, so nothing here starts compile workers): the wrapper every graph
of the compiled lowering goes through (``sexpgpu_torch.recompiles``).
"""

from __future__ import annotations

import structlog
import torch

from sexpgpu.log import get_logger
from sexpgpu_torch.recompiles import RECOMPILED, CompiledOnce, watching


def _double_plus_one(x):
    return x * 2 + 1


def test_a_guard_that_fails_after_the_first_call_is_said_once_and_the_call_still_runs():
    get_logger()  # configure structlog first, so capture_logs stays in force
    graph = CompiledOnce(torch.compile(_double_plus_one, backend="eager", dynamic=False))
    with structlog.testing.capture_logs() as logs:
        assert graph(torch.ones(3)).tolist() == [3.0] * 3  # the first call compiles
        assert graph(torch.ones(3)).tolist() == [3.0] * 3  # the same guards: nothing said
        assert [e for e in logs if e["event"] == RECOMPILED] == []
        assert graph(torch.ones(4)).tolist() == [3.0] * 4  # another shape compiles again
        assert graph(torch.ones(5)).tolist() == [3.0] * 5  # said once, not per compile
    said = [e for e in logs if e["event"] == RECOMPILED]
    assert len(said) == 1
    assert said[0]["log_level"] == "warning"
    assert said[0]["graph"].startswith("_double_plus_one in ")
    assert "size mismatch" in said[0]["guard"]
    # the recompile is not left switched into an error for other compiled code
    assert torch.compile(_double_plus_one, backend="eager")(torch.ones(2)).tolist() == [3.0] * 2


def test_inside_a_watched_stretch_a_recompile_is_said_too_and_the_watch_is_put_back():
    import torch._dynamo.config as dynamo_config

    get_logger()
    graph = CompiledOnce(torch.compile(_double_plus_one, backend="eager", dynamic=False))
    before = dynamo_config.error_on_recompile
    with structlog.testing.capture_logs() as logs:
        graph(torch.ones(3))
        with watching():  # a generation's trips: set once, not per call
            assert dynamo_config.error_on_recompile
            assert graph(torch.ones(3)).tolist() == [3.0] * 3
            assert graph(torch.ones(6)).tolist() == [3.0] * 6  # compiles again, said
            assert dynamo_config.error_on_recompile  # still watching after saying so
            assert graph(torch.ones(7)).tolist() == [3.0] * 7
    said = [e for e in logs if e["event"] == RECOMPILED]
    assert len(said) == 1 and "size mismatch" in said[0]["guard"]
    assert dynamo_config.error_on_recompile == before

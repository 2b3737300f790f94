"""Kernel choice: the rule, pinned choices, E-CHOICE-001, and a third-party kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from torch_build import G, param, program, site, stage

from sexpgpu.errors import CheckpointError
from sexpgpu.extension import KernelInfo
from sexpgpu.graph import TensorType
from sexpgpu.plugins import get_plugins, reset_plugins
from sexpgpu_torch import kernels as K
from sexpgpu_torch.lowering import choose_kernels
from tests.foundation.pluginkit import make_plugin

ATTN = "attention:model.attn"
CONV = "conv2d:model.conv"
STACK = "stack:model.blocks"


def sites_program(deterministic: bool = True):
    g = G()
    loss = g.add("sum", g.param("model.p", [2]), axes=(0,), keepdim=False)
    st = stage(g.graph(loss), {}, optimizer="sgd")
    return program(
        [param("model.p", [2])],
        [st],
        sites=[site(ATTN, "attention"), site(CONV, "conv2d"), site(STACK, "stack")],
        deterministic=deterministic,
    )


def builtin() -> list[KernelInfo]:
    return get_plugins().available("sexpgpu_kernels")


def names(chosen: dict[str, KernelInfo]) -> dict[str, str]:
    return {s: k.name for s, k in chosen.items()}


def test_deterministic_runs_take_the_best_deterministic_kernels() -> None:
    chosen = choose_kernels(sites_program(), device="cpu", kernels=builtin(), pinned=None)
    assert names(chosen) == {ATTN: "math", CONV: "direct", STACK: "unrolled"}


def test_non_deterministic_runs_may_take_sdpa() -> None:
    chosen = choose_kernels(sites_program(False), device="cuda:0", kernels=builtin(), pinned=None)
    assert names(chosen) == {ATTN: "sdpa", CONV: "direct", STACK: "unrolled"}


def _fake(name: str, priority: int, devices=("cpu",), deterministic=True, lowering="torch"):
    return KernelInfo(
        "attention", name, lowering, devices, deterministic, lambda: K.attention_math, priority
    )


def test_priority_then_name_and_only_fitting_kernels() -> None:
    kernels = builtin() + [
        _fake("zeta", 5),
        _fake("alpha", 5),
        _fake("gpu-only", 50, devices=("cuda",)),
        _fake("other-lowering", 60, lowering="jax"),
        _fake("racy", 70, deterministic=False),
    ]
    chosen = choose_kernels(sites_program(), device="cpu", kernels=kernels, pinned=None)
    assert chosen[ATTN].name == "alpha"
    chosen = choose_kernels(sites_program(False), device="cpu", kernels=kernels, pinned=None)
    assert chosen[ATTN].name == "racy"
    chosen = choose_kernels(sites_program(), device="cuda", kernels=kernels, pinned=None)
    assert chosen[ATTN].name == "gpu-only"


def test_pinned_choices_override_the_rule() -> None:
    pinned = {ATTN: "sdpa", STACK: "looped", "attention:gone": "math"}
    chosen = choose_kernels(sites_program(), device="cpu", kernels=builtin(), pinned=pinned)
    assert names(chosen) == {ATTN: "sdpa", CONV: "direct", STACK: "looped"}


@pytest.mark.parametrize(
    ("pinned", "kernels"),
    [
        ("flash", []),  # not installed at all
        ("gpu-only", [_fake("gpu-only", 0, devices=("cuda",))]),  # not on this device
        ("jaxy", [_fake("jaxy", 0, lowering="jax")]),  # not for this lowering
    ],
)
def test_a_pinned_choice_that_cannot_be_taken_is_e_choice_001(pinned, kernels) -> None:
    with pytest.raises(CheckpointError) as info:
        choose_kernels(
            sites_program(), device="cpu", kernels=builtin() + kernels, pinned={ATTN: pinned}
        )
    assert info.value.code == "E-CHOICE-001"
    text = str(info.value)
    assert text.startswith("E-CHOICE-001: ")
    assert ATTN in text and f"'{pinned}'" in text
    assert "\n" not in text


def test_trainer_records_every_site() -> None:
    plugins = get_plugins()
    trainer = (
        plugins.available("sexpgpu_lowerings")[0]
        .factory()
        .lower(
            sites_program(),
            device="cpu",
            kernels=builtin(),
            optimizers={o.name: o for o in plugins.available("sexpgpu_optimizers")},
            pinned={CONV: "direct"},
        )
    )
    assert dict(trainer.choices) == {ATTN: "math", CONV: "direct", STACK: "unrolled"}


PLUGIN = '''
"""A third-party kernel plugin made by the tests."""

from sexpgpu.extension import KernelInfo
from sexpgpu.hookspecs import hookimpl


def doubled_attention(q, k, v, *, heads, causal):
    from sexpgpu_torch.kernels import attention_math

    return 2 * attention_math(q, k, v, heads=heads, causal=causal)


@hookimpl
def sexpgpu_kernels():
    return [
        KernelInfo(
            kind="attention",
            name="doubled",
            lowering="torch",
            devices=("cpu",),
            deterministic=True,
            factory=lambda: doubled_attention,
            priority=100,
        )
    ]
'''


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    site_dir = make_plugin(tmp_path / "site", "myplug", {"myplug": PLUGIN}, {"myplug": "myplug"})
    monkeypatch.syspath_prepend(str(site_dir))
    reset_plugins()
    yield
    monkeypatch.undo()
    reset_plugins()


def test_a_third_party_kernel_is_chosen_and_called(third_party) -> None:
    g = G()
    x = g.input("x", [1, 3, 4])
    attn = g.add("attention", x, x, x, heads=2, causal=True, site=ATTN)
    loss = g.add("sum", attn, axes=(0, 1, 2), keepdim=False)
    fields = {"x": TensorType((1, 3, 4), "f32")}
    prog = program(
        [param("model.p", [2])],
        [stage(g.graph(loss), fields, optimizer="sgd")],
        evals=(),
        sites=[site(ATTN, "attention")],
    )
    plugins = get_plugins()
    assert plugins.record("myplug") is not None and plugins.record("myplug").available
    lowering = plugins.available("sexpgpu_lowerings")[0].factory()
    optimizers = {o.name: o for o in plugins.available("sexpgpu_optimizers")}
    batch = {"x": np.arange(12, dtype=np.float32).reshape(1, 3, 4) / 10}
    losses = {}
    for pinned in (None, {ATTN: "math"}):
        trainer = lowering.lower(
            prog,
            device="cpu",
            kernels=plugins.available("sexpgpu_kernels"),
            optimizers=optimizers,
            pinned=pinned,
        )
        trainer.init_params()
        losses[trainer.choices[ATTN]] = trainer.propose(batch, stage=0, step=1, lr=0.1).loss
    assert set(losses) == {"doubled", "math"}
    assert losses["doubled"] == pytest.approx(2 * losses["math"], rel=1e-6)

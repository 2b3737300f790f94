"""Kernel choice: the core's rule as the torch lowering uses it, pinned choices,
E-CHOICE-001, the kernel contracts, ``inline``, and a third-party kernel."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import numpy as np
import pytest
from torch_build import G, param, program, site, stage

from sexpgpu import kernels as choice
from sexpgpu.catalog import Catalog
from sexpgpu.choices import Choices
from sexpgpu.errors import CheckpointError, PluginError
from sexpgpu.extension import KernelInfo, Supplies
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops import KERNEL_CALLS
from sexpgpu_torch import kernels as K
from sexpgpu_torch.cpu_environment import is_cpu_choice
from tests.catalogs import project
from tests.foundation.pluginkit import make_plugin


def choose(program, *, pinned, lowering="torch", **kw):
    """The rule, with ``pinned`` choices recorded by a checkpoint."""
    return choice.choose_kernels(
        program, lowering=lowering, choices=Choices(recorded=pinned or {}), **kw
    )


# The rule as the torch lowering applies it.
choose_kernels = functools.partial(choose, lowering="torch")


def torch_lowering(plugins: Catalog):
    """The torch lowering of ``plugins``, and a ``lower`` that pins ``pinned``."""
    lowering = next(i for i in plugins.lowerings() if i.name == "torch").factory()

    def lower(program, *, kernels=None, pinned=None):
        supplies = Supplies(
            kernels=plugins.kernels() if kernels is None else kernels,
            optimizers=plugins.optimizers(),
        )
        return lowering.lower(
            program, device="cpu", supplies=supplies, choices=Choices(recorded=pinned or {})
        )

    return lower


ATTN = "attention:model.attn"
CONV = "conv2d:model.conv"
STACK = "stack:model.blocks"


def sites_program(deterministic: bool = True, kinds=("attention", "conv2d", "stack")):
    g = G()
    loss = g.add("sum", g.param("model.p", [2]), axes=(0,), keepdim=False)
    st = stage(g.graph(loss), {}, optimizer="sgd")
    every = {"attention": ATTN, "conv2d": CONV, "stack": STACK}
    return program(
        [param("model.p", [2])],
        [st],
        sites=[site(every[kind], kind) for kind in kinds],
        deterministic=deterministic,
    )


def builtin() -> list[KernelInfo]:
    return project().kernels()


names = choice.recorded


def test_deterministic_runs_take_the_best_deterministic_kernels() -> None:
    chosen = choose_kernels(sites_program(), device="cpu", kernels=builtin(), pinned=None)
    assert names(chosen) == {ATTN: "math", CONV: "direct", STACK: "unrolled"}


def test_on_cuda_the_eager_lowering_takes_the_cuda_plugin_s_kernels_too() -> None:
    # flash attention where it is deterministic (its backward's deterministic path is
    # taken under the determinism switch), as the compiled lowering does; cuDNN's
    # convolution engines, benchmarking only where the run is not deterministic
    chosen = choose_kernels(sites_program(), device="cuda:0", kernels=builtin(), pinned=None)
    assert names(chosen) == {ATTN: "flash", CONV: "cudnn", STACK: "unrolled"}
    chosen = choose_kernels(sites_program(False), device="cuda:0", kernels=builtin(), pinned=None)
    assert names(chosen) == {ATTN: "flash", CONV: "cudnn-benchmark", STACK: "unrolled"}
    assert all(k.lowering == "torch" for k in chosen.values())


def test_without_the_cuda_plugin_a_non_deterministic_run_may_take_sdpa() -> None:
    eager_own = [k for k in builtin() if "cuda" not in k.devices or "cpu" in k.devices]
    chosen = choose_kernels(sites_program(False), device="cuda:0", kernels=eager_own, pinned=None)
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


def test_a_site_no_kernel_fits_is_a_one_line_plugin_error() -> None:
    only_racy = [k for k in builtin() if k.kind != "attention"] + [
        _fake("racy", 0, deterministic=False)
    ]
    with pytest.raises(PluginError) as info:
        choose_kernels(sites_program(), device="cpu", kernels=only_racy, pinned=None)
    assert str(info.value) == (
        "test.sx:1:1: no deterministic attention kernel for the torch lowering on cpu "
        f"(needed by {ATTN}; see `sexpgpu plugins`)"
    )
    chosen = choose_kernels(sites_program(False), device="cpu", kernels=only_racy, pinned=None)
    assert chosen[ATTN].name == "racy"


def test_another_lowering_takes_only_its_own_kernels_by_the_same_rule() -> None:
    theirs = [
        _fake("low", 1, devices=("cuda",), lowering="cuda-c"),
        _fake("high", 9, devices=("cuda",), lowering="cuda-c"),
        _fake("racy", 20, devices=("cuda",), lowering="cuda-c", deterministic=False),
    ]
    attention_only = sites_program(kinds=("attention",))
    chosen = choose(
        attention_only, lowering="cuda-c", device="cuda:1", kernels=builtin() + theirs, pinned={}
    )
    assert names(chosen) == {ATTN: "high"}
    with pytest.raises(CheckpointError) as info:
        choose(
            attention_only,
            lowering="cuda-c",
            device="cuda:1",
            kernels=builtin() + theirs,
            pinned={ATTN: "math"},
        )
    assert str(info.value) == (
        f"E-CHOICE-001: the recorded choice 'math' for {ATTN} cannot be taken here: no "
        "available attention kernel 'math' for the cuda-c lowering on cuda "
        "(use --choices fresh to choose again)"
    )
    with pytest.raises(PluginError):
        choose(sites_program(), lowering="cuda-c", device="cuda", kernels=theirs, pinned=None)


def _parameters(fn) -> list[tuple[str, object]]:
    params = list(inspect.signature(fn).parameters.values())
    return [(p.name, p.kind) for p in params if p.name != "self"]


def test_the_built_in_kernels_follow_the_core_call_contracts() -> None:
    infos = builtin()
    assert {k.kind for k in infos} == set(KERNEL_CALLS)
    for info in infos:
        contract = KERNEL_CALLS[info.kind].__call__
        assert _parameters(info.factory()) == _parameters(contract), info.name


def test_only_the_unrolled_stack_kernel_may_be_inlined() -> None:
    assert {k.name for k in builtin() if k.inline} == {"unrolled"}


def test_trainer_records_every_site() -> None:
    trainer = torch_lowering(project())(sites_program(), pinned={CONV: "direct"})
    # the kernel choices, and beside them the CPU's (tests/determinism)
    kernel_choices = {k: v for k, v in trainer.choices.items() if not is_cpu_choice(k)}
    assert kernel_choices == {ATTN: "math", CONV: "direct", STACK: "unrolled"}


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
    yield Catalog.load()
    monkeypatch.undo()


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
    plugins = third_party
    assert plugins.record("myplug") is not None and plugins.record("myplug").available
    lower = torch_lowering(plugins)
    batch = {"x": np.arange(12, dtype=np.float32).reshape(1, 3, 4) / 10}
    losses = {}
    for pinned in (None, {ATTN: "math"}):
        trainer = lower(prog, pinned=pinned)
        trainer.init_params()
        losses[trainer.choices[ATTN]] = trainer.propose(batch, stage=0, step=1, lr=0.1).loss
    assert set(losses) == {"doubled", "math"}
    assert losses["doubled"] == pytest.approx(2 * losses["math"], rel=1e-6)


def repeat_program():
    """A two-iteration ``repeat`` at site STACK, and its loss."""
    body = G()
    carry = body.input("carry", [2, 4])
    out = body.add("tanh", body.add("matmul", carry, body.slot(0, [4, 4])))
    g = G()
    x = g.input("x", [2, 4])
    stack = g.add(
        "repeat",
        x,
        count=2,
        body=body.graph(out),
        slots=(("m.l.0.w",), ("m.l.1.w",)),
        site=STACK,
        type=g.nodes[x].type,
    )
    loss = g.add("sum", stack, axes=(0, 1), keepdim=False)
    return program(
        [param("m.l.0.w", [4, 4]), param("m.l.1.w", [4, 4])],
        [stage(g.graph(loss), {"x": TensorType((2, 4), "f32")})],
        sites=[site(STACK, "stack")],
    )


def test_inline_is_what_the_descriptor_says_not_which_function_it_is() -> None:
    """A stack kernel that says ``inline`` is never called (its iterations are emitted
    into the program); one that does not is called once per run of the repeat. Both
    give the bits the built-in kernels give."""
    calls: list[int] = []

    def counted(body, carry, per_iteration_slots):
        calls.append(len(per_iteration_slots))
        return K.stack_looped(body, carry, per_iteration_slots)

    def stack(name: str, inline: bool) -> KernelInfo:
        return KernelInfo("stack", name, "torch", ("cpu",), True, lambda: counted, inline=inline)

    lower = torch_lowering(project())
    kernels = builtin() + [stack("emitted", True), stack("called", False)]
    batch = {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}
    losses, counts = {}, {}
    for name in ("emitted", "called", "unrolled", "looped"):
        calls.clear()
        trainer = lower(repeat_program(), kernels=kernels, pinned={STACK: name})
        trainer.init_params()
        losses[name] = trainer.propose(batch, stage=0, step=1, lr=0.1).loss
        counts[name] = list(calls)
        assert {k: v for k, v in trainer.choices.items() if not is_cpu_choice(k)} == {STACK: name}
    assert counts == {"emitted": [], "called": [2], "unrolled": [], "looped": []}
    assert len(set(losses.values())) == 1, losses

"""The optimizers against torch.optim on the same parameters and gradients."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch_build import G, param, program, stage

from sexpgpu.choices import Choices
from sexpgpu.extension import OptimizerUpdate, Supplies
from sexpgpu.lang.ir import Init, TensorType
from sexpgpu_torch import optim
from tests.catalogs import project

CASES = [
    ("sgd", {"lr": 0.1}, lambda ps: torch.optim.SGD(ps, lr=0.1)),
    (
        "sgd",
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    ),
    (
        "sgd",
        {"lr": 0.05, "momentum": 0.8, "nesterov": True},
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    ),
    (
        "adam",
        {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1},
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    (
        "adamw",
        {"lr": 0.01, "weight_decay": 0.1},
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    ),
]


def _infos() -> dict:
    return project().optimizers()


@pytest.mark.parametrize(("name", "options", "reference"), CASES)
def test_update_matches_torch_optim(name: str, options: dict, reference) -> None:
    """Five updates with varying gradients agree with torch.optim to float rounding."""
    info = _infos()[name]
    full = {**info.options, **options}
    update = info.factory()
    gen = torch.Generator().manual_seed(1)
    ours = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    theirs = [p.clone().requires_grad_(True) for p in ours]
    ref = reference(theirs)
    states = update.init_states(ours, full)
    assert tuple(states) == info.state_names(full)
    for count in range(1, 6):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        before = [p.clone() for p in ours]
        new, states = update.propose(
            ours, grads, states, lr=options["lr"], count=count, options=full, decay=[True, True]
        )
        # Proposing leaves the current tensors as they were.
        assert all(torch.equal(a, b) for a, b in zip(before, ours, strict=True))
        ours = new
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g.clone()
        ref.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


def _call_shape(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(optim.UPDATES))
def test_every_update_follows_the_core_protocol(name: str) -> None:
    """Each built-in update has the core's OptimizerUpdate methods, called the same way,
    and its fresh states are the ones its descriptor names for the options."""
    update = _infos()[name].factory()
    for method in ("init_states", "propose"):
        protocol_method = getattr(OptimizerUpdate, method)
        assert _call_shape(getattr(update, method)) == _call_shape(protocol_method)[1:], method
    info = _infos()[name]
    options = {**info.options, "momentum": 0.9}
    params = [torch.ones(2, 3), torch.ones(4)]
    states = update.init_states(params, options)
    assert tuple(states) == info.state_names(options)
    for values in states.values():
        assert [(v.shape, v.dtype) for v in values] == [(p.shape, torch.float32) for p in params]
        assert all(not v.any() for v in values)


def test_adamw_skips_no_decay_tags() -> None:
    """adamw decays untagged parameters only; a tagged one moves as under plain Adam."""
    info = _infos()["adamw"]
    opts = {**info.options, "lr": 0.1, "weight_decay": 0.5}
    update = info.factory()
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(4, generator=gen), torch.randn(4, generator=gen)]
    grads = [torch.randn(4, generator=gen), torch.randn(4, generator=gen)]
    states = update.init_states(params, opts)
    new, _ = update.propose(
        params, grads, states, lr=0.1, count=1, options=opts, decay=[True, False]
    )
    ref = [p.clone().requires_grad_(True) for p in params]
    torch_opt = torch.optim.AdamW(
        [{"params": [ref[0]], "weight_decay": 0.5}, {"params": [ref[1]], "weight_decay": 0.0}],
        lr=0.1,
    )
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.clone()
    torch_opt.step()
    torch.testing.assert_close(new[0], ref[0].detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(new[1], ref[1].detach(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(new[0], ref[1].detach())


def test_bf16_parameters_update_in_f32_with_f32_states() -> None:
    info = _infos()["adam"]
    opts = dict(info.options)
    update = info.factory()
    p = [torch.randn(6).to(torch.bfloat16)]
    g = [torch.randn(6).to(torch.bfloat16)]
    states = update.init_states(p, opts)
    new, states = update.propose(p, g, states, lr=0.01, count=1, options=opts, decay=[True])
    assert new[0].dtype == torch.bfloat16
    assert states["m"][0].dtype == torch.float32
    expected = p[0].float() - 0.01 * torch.sign(g[0].float())  # Adam's first step
    torch.testing.assert_close(
        new[0].float(), expected.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2
    )


def test_clip_by_global_norm_matches_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(10, generator=gen) * 3, torch.randn(3, 3, generator=gen)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.5)
    ours = [g.clone() for g in grads]
    optim.clip_by_global_norm(ours, 1.5)
    for a, p in zip(ours, params, strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=1e-7)
    small = [torch.full((2,), 0.1)]
    optim.clip_by_global_norm(small, 1.5)  # under the limit: unchanged
    assert torch.equal(small[0], torch.full((2,), 0.1))


def _regression_program(optimizer: str, options: dict, clip: float | None, steps: int):
    g = G()
    x = g.input("x", [8, 3])
    y = g.input("y", [8, 2])
    w = g.param("model.w", [3, 2])
    b = g.param("model.b", [2])
    frozen = g.param("model.scale", [2])
    h = g.add("mul", g.add("add", g.add("matmul", x, w), b), frozen)
    loss = g.add("mse", g.add("tanh", h), y)
    fields = {"x": TensorType((8, 3), "f32"), "y": TensorType((8, 2), "f32")}
    params = [
        param("model.w", [3, 2]),
        param("model.b", [2], tags=("no-decay",)),
        param("model.scale", [2], init=Init("ones"), trainable=False),
    ]
    st = stage(g.graph(loss), fields, optimizer=optimizer, options=options, clip=clip, steps=steps)
    return program(params, [st])


@pytest.mark.parametrize(
    ("name", "options", "clip"),
    [
        ("sgd", {"lr": 0.5, "momentum": 0.9}, 0.05),
        ("adam", {"lr": 0.05}, None),
        ("adamw", {"lr": 0.05, "weight_decay": 0.2}, 0.1),
    ],
)
def test_trainer_steps_match_a_hand_written_torch_loop(name, options, clip) -> None:
    """Through the whole trainer (forward, backward, clipping, update, commit)."""
    prog = _regression_program(name, options, clip, steps=6)
    infos = _infos()
    lowering = next(i for i in project().lowerings() if i.name == "torch").factory()
    trainer = lowering.lower(
        prog,
        device="cpu",
        supplies=Supplies(kernels=project().kernels(), optimizers=infos),
        choices=Choices(),
    )
    trainer.init_params()
    params0, _ = trainer.export()
    w = torch.tensor(params0["model.w"], requires_grad=True)
    b = torch.tensor(params0["model.b"], requires_grad=True)
    if name == "sgd":
        ref = torch.optim.SGD([w, b], lr=options["lr"], momentum=options["momentum"])
    elif name == "adam":
        ref = torch.optim.Adam([w, b], lr=options["lr"])
    else:
        ref = torch.optim.AdamW(
            [{"params": [w], "weight_decay": 0.2}, {"params": [b], "weight_decay": 0.0}],
            lr=options["lr"],
        )
    rng = np.random.default_rng(0)
    for step in range(1, 7):
        batch = {
            "x": rng.standard_normal((8, 3)).astype(np.float32),
            "y": rng.standard_normal((8, 2)).astype(np.float32),
        }
        proposal = trainer.propose(batch, stage=0, step=step, lr=options["lr"])
        trainer.commit(proposal)
        ref.zero_grad()
        loss = torch.nn.functional.mse_loss(
            torch.tanh(torch.from_numpy(batch["x"]) @ w + b), torch.from_numpy(batch["y"])
        )
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([w, b], clip)
        ref.step()
        assert proposal.loss == pytest.approx(loss.item(), rel=1e-5)
    params, states = trainer.export()
    np.testing.assert_allclose(params["model.w"], w.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(params["model.b"], b.detach().numpy(), rtol=1e-5, atol=1e-6)
    # The frozen parameter has no states and did not move.
    assert not any(k.startswith("model.scale/") for k in states)
    np.testing.assert_array_equal(params["model.scale"], np.ones(2, np.float32))
    names = infos[name].state_names({**infos[name].options, **options})
    assert set(states) == {f"{p}/{n}" for p in ("model.w", "model.b") for n in names}

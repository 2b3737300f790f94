"""The built-in optimizers' updates as one compiled graph each (the compiled
strategy's, :mod:`sexpgpu_torch.compiled`).

The eager updates (:mod:`sexpgpu_torch.optim`) hand their per-step numbers (the
learning rate, Adam's bias corrections) to ``torch._foreach_*`` ops as Python
scalars, which a trace can only bake in: every step would compile again. Here the
same numbers are computed on the host as the eager update computes them and enter
the graph as 0-d tensors, so one graph serves every step of a run and every resume
of it; the options (betas, decay) are constants of the graph. The arithmetic is
the eager update's, term by term, written with torch's ``_foreach_*`` ops: each
term is one op of the trace for every tensor, not one per tensor, so a start traces
a few ops where it traced hundreds (a warm second start pays that trace again);
the steady-state speed measured the same as the per-tensor form's
(``benchmarks/bench_compiled.py``). An optimizer this module
does not know (a plugin's) runs its own update, uncompiled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import sexpgpu_torch.optim as eager
from sexpgpu_torch.recompiles import CompiledOnce

Tensor = torch.Tensor


def _host(value: float) -> Tensor:
    # computed in double on the host, then f32 as the eager foreach kernels take a
    # Python scalar; a 0-d CPU tensor, which a CUDA graph reads as a kernel argument
    return torch.tensor(eager.f32_scalar(value), dtype=torch.float32)


def _sgd_graph(options: Mapping[str, Any], decay: Sequence[bool]) -> Callable[..., Any]:
    momentum = float(options.get("momentum", 0.0))
    wd = float(options.get("weight_decay", 0.0))
    nesterov = bool(options.get("nesterov", False))

    def update(params, grads, states, neg_lr):  # noqa: ANN001
        p32, g = eager.as_f32(params), eager.as_f32(grads)
        if wd:
            g = torch._foreach_add(g, torch._foreach_mul(p32, wd))
        bufs: list[Tensor] = []
        if momentum > 0:
            bufs = torch._foreach_add(torch._foreach_mul(states["momentum"], momentum), g)
            g = torch._foreach_add(g, torch._foreach_mul(bufs, momentum)) if nesterov else bufs
        new_params = torch._foreach_add(p32, torch._foreach_mul(g, neg_lr))
        return eager.back_to(new_params, params), ({"momentum": bufs} if momentum > 0 else {})

    return update


def _sgd_scalars(lr: float, count: int, options: Mapping[str, Any]) -> tuple[Tensor, ...]:
    return (_host(-lr),)


def _adam_graph(decoupled: bool) -> Callable[..., Callable[..., Any]]:
    def graph(options: Mapping[str, Any], decay: Sequence[bool]) -> Callable[..., Any]:
        beta1 = float(options.get("beta1", 0.9))
        beta2 = float(options.get("beta2", 0.999))
        eps = float(options.get("eps", 1e-8))
        wd = float(options.get("weight_decay", 0.0))
        shrinks = bool(wd and decoupled and any(decay))

        def update(params, grads, states, neg_step, bias2_root, shrink):  # noqa: ANN001
            p32, g = eager.as_f32(params), eager.as_f32(grads)
            if wd and not decoupled:
                g = torch._foreach_add(g, torch._foreach_mul(p32, wd))
            m = torch._foreach_lerp(states["m"], g, 1 - beta1)
            v = torch._foreach_add(
                torch._foreach_mul(states["v"], beta2),
                torch._foreach_mul(torch._foreach_mul(g, g), 1 - beta2),
            )
            denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(v), bias2_root), eps)
            base = p32
            if shrinks:  # decoupled decay of the tensors it applies to
                shrunk = iter(
                    torch._foreach_mul([p for p, d in zip(p32, decay, strict=True) if d], shrink)
                )
                base = [next(shrunk) if d else p for p, d in zip(p32, decay, strict=True)]
            steps = torch._foreach_mul(torch._foreach_div(m, denom), neg_step)
            return eager.back_to(torch._foreach_add(base, steps), params), {"m": m, "v": v}

        return update

    return graph


def _adam_scalars(lr: float, count: int, options: Mapping[str, Any]) -> tuple[Tensor, ...]:
    beta1 = float(options.get("beta1", 0.9))
    beta2 = float(options.get("beta2", 0.999))
    wd = float(options.get("weight_decay", 0.0))
    step_size = lr / (1 - beta1**count)
    return _host(-step_size), _host(math.sqrt(1 - beta2**count)), _host(1 - lr * wd)


_COMPILED: dict[type, tuple[Callable[..., Callable[..., Any]], Callable[..., tuple]]] = {
    eager.SGD: (_sgd_graph, _sgd_scalars),
    eager.Adam: (_adam_graph(False), _adam_scalars),
    eager.AdamW: (_adam_graph(True), _adam_scalars),
}
"""Each built-in update: (its graph for given options and decay flags, its host scalars)."""


class CompiledUpdate(eager.StandIn):
    """A built-in update as one compiled graph per options and decay flags (one per
    stage, in practice): :class:`~sexpgpu_torch.optim.StandIn` of the eager update; a
    plugin's runs its own ``propose``."""

    def __init__(self, update: Any, backend: str) -> None:
        super().__init__(update, _COMPILED.get(type(update)))
        self.backend = backend
        self._graphs: dict[tuple, Callable[..., Any]] = {}

    def propose_by_form(self, params, grads, states, *, lr, count, options, decay):  # noqa: ANN001
        """New parameters and states through the compiled graph."""
        graph_of, scalars_of = self.form
        key = (tuple(sorted((k, repr(v)) for k, v in options.items() if k != "lr")), tuple(decay))
        graph = self._graphs.get(key)
        if graph is None:
            compiled = torch.compile(graph_of(options, decay), backend=self.backend, dynamic=False)
            graph = CompiledOnce(compiled)
            self._graphs[key] = graph
        lists = {name: list(values) for name, values in states.items()}
        return graph(params, grads, lists, *scalars_of(lr, count, options))

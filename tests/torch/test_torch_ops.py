"""Every op of docs/ir.md through the torch lowering, against a PyTorch reference written
out independently: values, and gradients of every floating input through autograd."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch_build import G

from sexpgpu_torch import kernels as K
from sexpgpu_torch.graphs import Ctx, compile_graph

CPU = torch.device("cpu")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed))


def positive(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(shape, generator=_gen(seed)) + 0.5


def check(
    build: Callable[..., int],
    params: dict[str, torch.Tensor],
    ref: Callable[..., torch.Tensor],
    *,
    inputs: dict[str, torch.Tensor] | None = None,
    kernels: dict[str, Callable] | None = None,
    inline: frozenset[str] = frozenset(),
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Build a graph reading ``params`` (as parameters) and ``inputs`` (as data), run it,
    and compare its output and the gradients of ``sum(out * r)`` for a random ``r``."""
    inputs = inputs or {}
    dtypes = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int64: "i64", torch.bool: "bool"}
    g = G()
    nodes = {p: g.param(p, t.shape, dtypes[t.dtype]) for p, t in params.items()}
    nodes.update({n: g.input(n, t.shape, dtypes[t.dtype]) for n, t in inputs.items()})
    out = build(g, nodes)
    ctx = Ctx(seed=0, device=CPU)
    ours = {p: t.clone().requires_grad_(t.is_floating_point()) for p, t in params.items()}
    theirs = {p: t.clone().requires_grad_(t.is_floating_point()) for p, t in params.items()}
    ctx.params = ours
    ctx.inputs = dict(inputs)
    (y,) = compile_graph(g.graph(out), ctx, kernels or {}, CPU, inline)()
    y_ref = ref(**theirs, **inputs)
    assert y.shape == y_ref.shape
    assert tuple(y.shape) == g.nodes[out].type.shape, "the IR's shape rule and torch disagree"
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    floats = [p for p, t in params.items() if t.is_floating_point()]
    assert y.requires_grad == y_ref.requires_grad
    if floats and y.requires_grad:
        r = torch.randn(y.shape, generator=_gen(99)).to(y.dtype)
        ours_g = torch.autograd.grad((y * r).sum(), [ours[p] for p in floats], allow_unused=True)
        ref_g = torch.autograd.grad(
            (y_ref * r).sum(), [theirs[p] for p in floats], allow_unused=True
        )
        for name, a, b in zip(floats, ours_g, ref_g, strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=f"gradient of {name}")


BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a**b,
    "maximum": lambda a, b: torch.where(a >= b, a, b),
    "minimum": lambda a, b: torch.where(a <= b, a, b),
}


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_broadcasting(op: str) -> None:
    a, b = positive(3, 4, seed=1), positive(4, seed=2)
    check(lambda g, n: g.add(op, n["a"], n["b"]), {"a": a, "b": b}, BINARY[op])


def test_binary_with_constants_and_bf16_promotion() -> None:
    """A bf16 tensor against an f32 one gives f32, as the IR says."""
    a = randn(3, 4, seed=3).to(torch.bfloat16)
    b = randn(4, seed=4)
    check(
        lambda g, n: g.add("mul", g.add("add", n["a"], n["b"]), g.const(2.0)),
        {"a": a, "b": b},
        lambda a, b: (a.float() + b) * 2.0,
    )
    check(
        lambda g, n: g.add("pow", n["b"], g.const(2)),
        {"b": b},
        lambda b: b * b,
    )


UNARY = {
    "neg": (lambda x: -x, randn),
    "relu": (lambda x: torch.clamp(x, min=0), randn),
    "gelu": (lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), randn),
    "silu": (lambda x: x / (1 + torch.exp(-x)), randn),
    "tanh": (lambda x: (torch.exp(2 * x) - 1) / (torch.exp(2 * x) + 1), randn),
    "sigmoid": (lambda x: 1 / (1 + torch.exp(-x)), randn),
    "exp": (torch.exp, randn),
    "log": (torch.log, positive),
    "sqrt": (lambda x: x**0.5, positive),
    "rsqrt": (lambda x: 1 / x**0.5, positive),
    "abs": (lambda x: torch.where(x >= 0, x, -x), randn),
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op: str) -> None:
    ref, make = UNARY[op]
    check(lambda g, n: g.add(op, n["x"]), {"x": make(3, 5, seed=5)}, ref)


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [((2, 3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((2, 3, 4), (2, 4, 5))],
)
def test_matmul(a_shape, b_shape) -> None:
    def ref(a, b):
        if a.dim() == 1:
            return (a[:, None] * b).sum(0)
        if b.dim() == 1:
            return (a * b).sum(-1)
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)

    check(
        lambda g, n: g.add("matmul", n["a"], n["b"]),
        {"a": randn(*a_shape, seed=6), "b": randn(*b_shape, seed=7)},
        ref,
    )


def test_reshape_transpose_concat_slice() -> None:
    x, y = randn(2, 3, 4, seed=8), randn(2, 5, 4, seed=9)
    check(lambda g, n: g.add("reshape", n["x"], shape=(6, 4)), {"x": x}, lambda x: x.view(6, 4))
    check(
        lambda g, n: g.add("transpose", n["x"], axes=(0, 2)),
        {"x": x},
        lambda x: x.permute(2, 1, 0),
    )
    check(
        lambda g, n: g.add("concat", n["x"], n["y"], n["x"], axis=1),
        {"x": x, "y": y},
        lambda x, y: torch.cat([x, y, x], 1),
    )
    check(
        lambda g, n: g.add("slice", n["y"], axis=1, start=1, stop=4),
        {"y": y},
        lambda y: y[:, 1:4],
    )


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions(op: str, keepdim: bool) -> None:
    x = randn(2, 3, 4, seed=10)

    def ref(x):
        if op == "max":
            y = x.max(dim=2, keepdim=True).values.max(dim=0, keepdim=True).values
        else:
            y = x.sum(dim=(0, 2), keepdim=True)
            if op == "mean":
                y = y / 8
        return y if keepdim else y.reshape(3)

    check(lambda g, n: g.add(op, n["x"], axes=(0, 2), keepdim=keepdim), {"x": x}, ref)


def test_softmax_and_log_softmax() -> None:
    x = randn(3, 5, seed=11)

    def softmax(x, axis):
        e = torch.exp(x - x.max(dim=axis, keepdim=True).values)
        return e / e.sum(dim=axis, keepdim=True)

    check(lambda g, n: g.add("softmax", n["x"], axis=0), {"x": x}, lambda x: softmax(x, 0))
    check(
        lambda g, n: g.add("log_softmax", n["x"], axis=1),
        {"x": x},
        lambda x: torch.log(softmax(x, 1)),
    )


def test_take_is_an_embedding_lookup() -> None:
    table = randn(10, 4, seed=12)
    idx = torch.tensor([[1, 3, 3], [0, 9, 1]])
    check(
        lambda g, n: g.add("take", n["table"], n["idx"]),
        {"table": table},
        lambda table, idx: torch.stack([torch.stack([table[int(i)] for i in row]) for row in idx]),
        inputs={"idx": idx},
    )
    table3 = randn(6, 2, 3, seed=13)
    check(
        lambda g, n: g.add("take", n["table"], n["idx"]),
        {"table": table3},
        lambda table, idx: table.index_select(0, idx.reshape(-1)).reshape(2, 3, 2, 3),
        inputs={"idx": torch.tensor([[1, 5, 0], [2, 2, 4]])},
    )


@pytest.mark.parametrize("op", ["lt", "le", "gt", "ge", "eq", "ne"])
def test_comparisons_give_bool_with_broadcasting(op: str) -> None:
    x = torch.tensor([[0.5, 1.0, 2.0], [1.0, -1.0, 0.5]])
    y = torch.tensor([1.0, 1.0, 0.5])
    ref = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}
    ref |= {"eq": torch.eq, "ne": torch.ne}
    check(
        lambda g, n: g.add(op, n["x"], n["y"]),
        {},
        lambda x, y: ref[op](x, y),
        inputs={"x": x, "y": y},
    )
    ids = torch.tensor([[3, 1], [0, 3]])
    check(
        lambda g, n: g.add(op, n["ids"], g.const(3)),
        {},
        lambda ids: ref[op](ids, torch.tensor(3)),
        inputs={"ids": ids},
    )


def test_where_picks_by_its_condition_and_passes_gradients_to_both_sides() -> None:
    a, b = randn(2, 3, seed=40), randn(3, seed=41)
    cond = torch.tensor([[True, False, True], [False, False, True]])
    check(
        lambda g, n: g.add("where", n["cond"], n["a"], n["b"]),
        {"a": a, "b": b},
        lambda a, b, cond: torch.where(cond, a, b),
        inputs={"cond": cond},
    )
    # the condition made in the graph, and a number on one side
    check(
        lambda g, n: g.add("where", g.add("gt", n["a"], g.const(0.0)), n["a"], g.const(0.0)),
        {"a": a},
        lambda a: torch.where(a > 0, a, torch.zeros(())),
    )


@pytest.mark.parametrize("keepdim", [False, True])
def test_argmax_is_the_first_largest_position(keepdim: bool) -> None:
    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 0.0, -1.0]])
    check(
        lambda g, n: g.add("argmax", n["x"], axis=1, keepdim=keepdim),
        {},
        lambda x: torch.argmax(x, dim=1, keepdim=keepdim),
        inputs={"x": x},
    )
    assert torch.argmax(x, dim=1).tolist() == [1, 0]


def test_gather_reads_one_value_per_row_or_torch_s_gather() -> None:
    logp = randn(2, 3, 5, seed=42)
    tokens = torch.tensor([[4, 0, 2], [1, 1, 3]])
    check(
        lambda g, n: g.add("gather", n["logp"], n["tokens"], axis=2),
        {"logp": logp},
        lambda logp, tokens: torch.stack(
            [torch.stack([logp[b, t, tokens[b, t]] for t in range(3)]) for b in range(2)]
        ),
        inputs={"tokens": tokens},
    )
    x = randn(3, 4, seed=43)
    idx = torch.tensor([[0, 3], [2, 2], [1, 0]])
    check(
        lambda g, n: g.add("gather", n["x"], n["idx"], axis=1),
        {"x": x},
        lambda x, idx: torch.gather(x, 1, idx),
        inputs={"idx": idx},
    )


def test_stop_gradient_passes_values_and_no_gradient() -> None:
    x = randn(2, 3, seed=44)
    check(
        lambda g, n: g.add("mul", n["x"], g.add("stop_gradient", n["x"])),
        {"x": x},
        lambda x: x * x.detach(),
    )


@pytest.mark.parametrize("op", ["group_mean", "group_std"])
def test_group_statistics_normalise_each_sample_against_its_prompt_s(op: str) -> None:
    r = randn(6, 2, seed=45)  # 3 prompts, 2 samples each, a value per sample and column

    def ref(r):
        rows = []
        for k in range(3):
            group = r[2 * k : 2 * k + 2]
            value = group.mean(dim=0) if op == "group_mean" else group.std(dim=0)
            rows += [value, value]
        return torch.stack(rows)

    check(lambda g, n: g.add(op, n["r"], size=2), {"r": r}, ref)


def test_layer_norm_and_rms_norm() -> None:
    x, w, b = randn(2, 3, 6, seed=14), randn(6, seed=15), randn(6, seed=16)

    def ln(x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * w + b

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    check(
        lambda g, n: g.add("layer_norm", n["x"], n["w"], n["b"], eps=1e-5),
        {"x": x, "w": w, "b": b},
        ln,
    )
    check(lambda g, n: g.add("rms_norm", n["x"], n["w"], eps=1e-6), {"x": x, "w": w}, rms)


def _attention_ref(q, k, v, heads, causal):
    b, t, d = q.shape
    hd = d // heads
    outs = []
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        s = torch.einsum("bqd,bkd->bqk", q[..., sl], k[..., sl]) / math.sqrt(hd)
        if causal:
            allowed = torch.tril(torch.ones(t, t, dtype=torch.bool))
            s = torch.where(allowed, s, torch.full_like(s, -1e30))
        outs.append(torch.einsum("bqk,bkd->bqd", torch.softmax(s, -1), v[..., sl]))
    return torch.cat(outs, -1)


@pytest.mark.parametrize("kernel", ["math", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention(kernel: str, causal: bool) -> None:
    fn = {"math": K.attention_math, "sdpa": K.attention_sdpa}[kernel]
    q, k, v = randn(2, 5, 8, seed=17), randn(2, 5, 8, seed=18), randn(2, 5, 8, seed=19)
    check(
        lambda g, n: g.add(
            "attention", n["q"], n["k"], n["v"], heads=2, causal=causal, site="attention:m.a"
        ),
        {"q": q, "k": k, "v": v},
        lambda q, k, v: _attention_ref(q, k, v, 2, causal),
        kernels={"attention:m.a": fn},
    )


def _conv_ref(x, w, b=None, *, stride, padding):
    o, c, kh, kw = w.shape
    cols = F.unfold(x, (kh, kw), padding=padding, stride=stride)  # [B, C*kh*kw, L]
    h = (x.shape[2] + 2 * padding - kh) // stride + 1
    wd = (x.shape[3] + 2 * padding - kw) // stride + 1
    out = (w.reshape(o, -1) @ cols).reshape(x.shape[0], o, h, wd)
    return out if b is None else out + b[None, :, None, None]


@pytest.mark.parametrize("bias", [True, False])
def test_conv2d(bias: bool) -> None:
    x, w, b = randn(2, 3, 7, 6, seed=20), randn(4, 3, 3, 2, seed=21), randn(4, seed=22)
    params = {"x": x, "w": w, **({"b": b} if bias else {})}

    def build(g, n):
        args = [n["x"], n["w"]] + ([n["b"]] if bias else [])
        return g.add("conv2d", *args, stride=2, padding=1, site="conv2d:m.c")

    check(
        build,
        params,
        lambda **p: _conv_ref(p["x"], p["w"], p.get("b"), stride=2, padding=1),
        kernels={"conv2d:m.c": K.conv2d_direct},
    )


def test_pooling() -> None:
    x = randn(2, 3, 6, 7, seed=23)

    def windows(x):  # [B, C, H', W', k*k] for kernel 2, stride 2
        return x.unfold(2, 2, 2).unfold(3, 2, 2).reshape(2, 3, 3, 3, 4)

    check(
        lambda g, n: g.add("max_pool2d", n["x"], kernel=2, stride=2),
        {"x": x},
        lambda x: windows(x).max(-1).values,
    )
    check(
        lambda g, n: g.add("avg_pool2d", n["x"], kernel=2, stride=2),
        {"x": x},
        lambda x: windows(x).mean(-1),
    )


def test_losses_and_accuracy() -> None:
    logits = randn(2, 4, 5, seed=24)
    targets = torch.tensor([[1, -1, 4, 0], [2, 2, -1, 3]])

    def ce(logits, targets):
        logp = logits - torch.logsumexp(logits, -1, keepdim=True)
        mask = targets >= 0
        picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return -(picked * mask).sum() / mask.sum()

    check(
        lambda g, n: g.add("cross_entropy", n["logits"], n["t"]),
        {"logits": logits},
        lambda logits, t: ce(logits, t),
        inputs={"t": targets},
    )
    check(
        lambda g, n: g.add("accuracy", n["logits"], n["t"]),
        {"logits": logits},
        lambda logits, t: ((logits.argmax(-1) == t) & (t >= 0)).sum().float() / (t >= 0).sum(),
        inputs={"t": targets},
    )
    p, t = randn(3, 4, seed=25), randn(3, 4, seed=26)
    check(
        lambda g, n: g.add("mse", n["p"], n["t"]),
        {"p": p, "t": t},
        lambda p, t: ((p - t) ** 2).sum() / 12,
    )


def test_cast_and_const() -> None:
    x = randn(3, 4, seed=27)
    check(
        lambda g, n: g.add("cast", n["x"], dtype="bf16"),
        {"x": x},
        lambda x: x.to(torch.bfloat16),
    )
    check(
        lambda g, n: g.add("add", n["x"], g.const(1.5)),
        {"x": x},
        lambda x: x + 1.5,
    )


def test_dropout_is_identity_outside_training() -> None:
    x = randn(4, 5, seed=28)
    check(lambda g, n: g.add("dropout", n["x"], p=0.5, key=1), {"x": x}, lambda x: x * 1.0)


def _repeat_build(kernel_site: str):
    def build(g, n):
        body = G()
        carry = body.input("carry", [2, 4])
        w = body.slot(0, [4, 4])
        b = body.slot(1, [4])
        out = body.add("tanh", body.add("add", body.add("matmul", carry, w), b))
        return g.add(
            "repeat",
            n["x"],
            count=3,
            body=body.graph(out),
            slots=tuple((f"m.l.{i}.w", f"m.l.{i}.b") for i in range(3)),
            site=kernel_site,
            type=g.nodes[n["x"]].type,
        )

    return build


@pytest.mark.parametrize("kernel", ["unrolled", "looped"])
def test_repeat(kernel: str) -> None:
    params = {"x": randn(2, 4, seed=29)}
    for i in range(3):
        params[f"m.l.{i}.w"] = randn(4, 4, seed=30 + i)
        params[f"m.l.{i}.b"] = randn(4, seed=40 + i)

    def ref(x, **p):
        for i in range(3):
            x = torch.tanh(x @ p[f"m.l.{i}.w"] + p[f"m.l.{i}.b"])
        return x

    fn = {"unrolled": K.stack_unrolled, "looped": K.stack_looped}[kernel]
    # unrolled is the inline kernel: its iterations are emitted into the graph itself
    inline = frozenset({"stack:m.l"}) if kernel == "unrolled" else frozenset()
    check(_repeat_build("stack:m.l"), params, ref, kernels={"stack:m.l": fn}, inline=inline)


def test_reducing_over_no_axis_leaves_x_as_it_is() -> None:
    x = randn(2, 3, seed=50)
    check(lambda g, n: g.add("sum", n["x"], axes=(), keepdim=False), {"x": x}, lambda x: x * 1.0)


def test_the_op_table_implements_exactly_the_registered_ops() -> None:
    # The structural ops (input, param, const, repeat) are the graph compiler's own:
    # they have no spec and no table entry.
    from sexpgpu.lang.ops import BUILTINS, STRUCTURAL
    from sexpgpu_torch.ops import IMPLEMENTATIONS

    assert set(IMPLEMENTATIONS) == BUILTINS.names()
    assert not set(STRUCTURAL) & (set(IMPLEMENTATIONS) | BUILTINS.names())


def test_the_torch_plugin_supplies_each_builtin_op_through_sexpgpu_ops() -> None:
    import sexpgpu_torch
    from sexpgpu.lang.ops import BUILTINS
    from sexpgpu_torch.ops import IMPLEMENTATIONS

    infos = sexpgpu_torch.sexpgpu_ops()
    assert sorted(i.name for i in infos) == sorted(BUILTINS.names())
    for info in infos:
        assert info.spec is BUILTINS.get(info.name)
        assert info.implementations["torch"]() is IMPLEMENTATIONS[info.name]
        assert info.doc


def test_every_registered_op_is_checked_in_this_file() -> None:
    from pathlib import Path

    from sexpgpu.lang.ops import BUILTINS

    text = Path(__file__).read_text()
    assert sorted(op for op in BUILTINS.names() if f'"{op}"' not in text) == []


# ---------------------------------------------------------------- mixed dtypes

_MIXED = ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16))
"""(the first argument's dtype, the others'): each op computes in the IR's promotion."""

# op -> (argument shapes, attrs); the first argument takes the first dtype of a pair
_MIXED_OPS: dict[str, tuple[tuple[tuple[int, ...], ...], dict]] = {
    **{op: (((3, 4), (3, 4)), {}) for op in BINARY},
    "matmul": (((3, 4), (4, 5)), {}),
    "concat": (((3, 4), (2, 4)), {"axis": 0}),
    "layer_norm": (((3, 4), (4,), (4,)), {"eps": 1e-5}),
    "rms_norm": (((3, 4), (4,)), {"eps": 1e-6}),
    "attention": (((2, 3, 4), (2, 3, 4), (2, 3, 4)), {"heads": 2, "causal": True}),
    "conv2d": (((1, 2, 5, 5), (3, 2, 3, 3), (3,)), {"stride": 1, "padding": 0}),
    "mse": (((3, 4), (3, 4)), {}),
}
_MIXED_KERNELS = {"attention": K.attention_math, "conv2d": K.conv2d_direct}


@pytest.mark.parametrize("dtypes", _MIXED, ids=["bf16-f32", "f32-bf16"])
@pytest.mark.parametrize("op", sorted(_MIXED_OPS))
def test_an_op_on_mixed_dtypes_runs_in_the_dtype_the_ir_gives(op, dtypes) -> None:
    """What the compiler accepts, the lowering runs: forward in the node's dtype, and
    a gradient for every argument in the argument's own dtype."""
    shapes, attrs = _MIXED_OPS[op]
    params = {
        f"p{i}": positive(*shape, seed=i).to(dtypes[min(i, 1)]).requires_grad_()
        for i, shape in enumerate(shapes)
    }
    g = G()
    nodes = [
        g.param(p, t.shape, "bf16" if t.dtype == torch.bfloat16 else "f32")
        for p, t in params.items()
    ]
    site = {"site": f"{op}:m"} if op in _MIXED_KERNELS else {}
    out = g.add(op, *nodes, **attrs, **site)
    ctx = Ctx(seed=0, device=CPU)
    ctx.params = params
    ctx.inputs = {}
    kernels = {f"{op}:m": _MIXED_KERNELS[op]} if op in _MIXED_KERNELS else {}
    (y,) = compile_graph(g.graph(out), ctx, kernels, CPU)()
    want = g.nodes[out].type
    assert tuple(y.shape) == want.shape
    assert y.dtype == {"f32": torch.float32, "bf16": torch.bfloat16}[want.dtype]
    assert want.dtype == "f32", "f32 wins over bf16"
    grads = torch.autograd.grad(y.float().sum(), list(params.values()))
    for (name, p), grad in zip(params.items(), grads, strict=True):
        assert grad.dtype == p.dtype, name
        assert torch.isfinite(grad.float()).all(), name


def test_a_graph_compiles_to_one_readable_line_per_op_and_its_own_code() -> None:
    """A graph is one straight-line function whose source a traceback (and torch.compile)
    can show; two trainers' graphs are two code objects, so torch.compile keeps one
    cache per graph, not one shared by every graph of the process."""
    import inspect
    import traceback

    g = G()
    x, w = g.input("x", (2, 3)), g.param("w", (3, 3))
    y = g.add("relu", g.add("matmul", x, w))
    out = g.add("add", y, g.const(1.0))
    ctx = Ctx(seed=0, device=CPU)
    ctx.params, ctx.inputs = {"w": randn(3, 3)}, {"x": randn(2, 3, seed=1)}
    run = compile_graph(g.graph(out), ctx, {}, CPU)
    lines = inspect.getsource(run).splitlines()
    assert lines[1:3] == ["    v0 = ctx.inputs['x']", "    v1 = ctx.params['w']"]
    assert len(lines) == 1 + 5 + 1, "a line per input, param and op; none for the constant"
    (value,) = run()
    torch.testing.assert_close(value, torch.relu(ctx.inputs["x"] @ ctx.params["w"]) + 1.0)
    assert compile_graph(g.graph(out), ctx, {}, CPU).__code__ is not run.__code__

    ctx.inputs = {}
    with pytest.raises(KeyError) as raised:
        run()
    shown = "".join(traceback.format_tb(raised.value.__traceback__))
    assert "v0 = ctx.inputs['x']" in shown

"""The core's rule for a user's kernel requests (`sexpgpu run --choose`), on kernels
made here: what a request names, how it meets a resume's recorded choices, and how
the one rule (`choose_kernels`) takes and checks it, whatever kernels are installed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sexpgpu.choices import Choices, kernel_requests
from sexpgpu.errors import CheckpointError, PluginError, Pos, UsageError
from sexpgpu.extension import KernelInfo
from sexpgpu.kernels import choose_kernels, recorded
from sexpgpu.lang.ir import ChoiceSite
from sexpgpu.session import Target
from sexpgpu_cli.options import parse_requests

OPTIONS = {"cpu.threads": "--threads"}
"""The choices `sexpgpu run` sets with options of its own, besides --lowering."""

POS = Pos("toy.sx", 1, 1)
A1, A2, S = "attention:net.a1", "attention:net.a2", "stack:net.blocks"


def _program(*, deterministic: bool = True, sites: tuple[str, ...] = (A1, A2, S)) -> Any:
    """What the rule reads of a program: its sites and whether it runs deterministic."""
    made = tuple(ChoiceSite(name, name.split(":")[0], POS) for name in sites)
    return SimpleNamespace(sites=made, run=SimpleNamespace(deterministic=deterministic))


def _kernel(kind: str, name: str, *, priority: int = 0, det: bool = True, **kw: Any) -> KernelInfo:
    return KernelInfo(
        kind=kind,
        name=name,
        lowering=kw.get("lowering", "toy"),
        devices=kw.get("devices", ("cpu",)),
        deterministic=det,
        factory=lambda: lambda *a, **k: None,
        priority=priority,
    )


KERNELS = [
    _kernel("attention", "plain"),
    _kernel("attention", "fast", priority=10, det=False),
    _kernel("attention", "gpu-only", priority=30, devices=("cuda",)),
    _kernel("attention", "elsewhere", priority=40, lowering="other"),
    _kernel("stack", "unrolled", priority=10),
    _kernel("stack", "recompute", priority=-10),
]


def pin_requests(program: Any, requests: Any, pinned: Any) -> Choices:
    """The run's choices: ``--choose requests`` against a checkpoint's ``pinned``."""
    return Target(choose=dict(requests or {}), options=OPTIONS).choices(program, pinned)


def _choose(program: Any, choices: Any) -> dict[str, str]:
    if not isinstance(choices, Choices):  # a checkpoint's record
        choices = Choices(recorded=choices or {})
    return recorded(
        choose_kernels(program, lowering="toy", device="cpu", kernels=KERNELS, choices=choices)
    )


# ------------------------------------------------------------------ parsing


def test_requests_parse_and_a_target_given_twice_takes_its_last_kernel() -> None:
    assert parse_requests(["attention=fast", f" {S} = recompute ", "attention=plain"]) == {
        "attention": "plain",
        S: "recompute",
    }
    assert parse_requests([]) == {}


@pytest.mark.parametrize("item", ["attention", "=plain", "attention=", " = "])
def test_a_malformed_request_is_a_usage_error(item: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_requests([item])
    assert caught.value.exit_code == 2
    assert str(caught.value) == f"--choose takes SITE=KERNEL or KIND=KERNEL, got '{item}'"


# ------------------------------------------------------------------ naming sites


def test_a_kind_names_each_of_its_sites_and_a_full_name_wins_over_it() -> None:
    wanted = kernel_requests(_program(), {"attention": "fast", A2: "plain"})
    assert wanted == (
        {A1: "fast", A2: "plain"},
        {A1: "--choose attention=fast", A2: f"--choose {A2}=plain"},
    )
    # the same requests in the other order: the full name still wins
    assert kernel_requests(_program(), {A2: "plain", "attention": "fast"}) == wanted


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("atention", "no choice site or kind 'atention' (did you mean 'attention'? its sites: "),
        ("conv2d", "no choice site or kind 'conv2d' (its sites: "),
        ("lowering", "lowering is not a kernel choice site; use --lowering"),
        ("cpu.threads", "cpu.threads is not a kernel choice site; use --threads"),
    ],
)
def test_a_target_the_program_lacks_is_a_usage_error(target: str, says: str) -> None:
    with pytest.raises(UsageError) as caught:
        kernel_requests(_program(), {target: "plain"}, OPTIONS)
    assert str(caught.value).startswith(f"--choose {target}=plain: ")
    assert says in str(caught.value)


def test_a_program_without_sites_says_it_has_none() -> None:
    with pytest.raises(UsageError, match=r"no choice site or kind 'stack' \(it has none\)$"):
        kernel_requests(_program(sites=()), {"stack": "unrolled"})


# ------------------------------------------------------------------ meeting the record


def test_no_request_leaves_the_pins_as_they_are() -> None:
    pins = {A1: "plain"}
    assert pin_requests(_program(), {}, pins).pins() == pins
    assert pin_requests(_program(), None, None).pins() == {}


def test_a_request_against_the_recorded_kernel_is_e_choice_001() -> None:
    with pytest.raises(CheckpointError) as caught:
        pin_requests(_program(), {"stack": "recompute"}, {S: "unrolled", "lowering": "toy"})
    assert caught.value.code == "E-CHOICE-001"
    assert str(caught.value) == (
        f"E-CHOICE-001: the recorded choice 'unrolled' for {S} cannot be taken with "
        "--choose stack=recompute (use --choices fresh to choose again)"
    )


def test_a_request_equal_to_the_record_is_the_recorded_pin() -> None:
    pins = pin_requests(_program(), {A1: "plain", A2: "fast"}, {A1: "plain"})
    assert pins.pins() == {A1: "plain", A2: "fast"}
    assert pins.asked == {A2: f"--choose {A2}=fast"}  # A1 stays a recorded pin
    assert not pins.is_request(A1) and pins.is_request(A2)


# ------------------------------------------------------------------ the rule takes it


def test_a_request_wins_over_the_rule_and_only_where_asked() -> None:
    program = _program()
    assert _choose(program, None) == {A1: "plain", A2: "plain", S: "unrolled"}
    pins = pin_requests(program, {S: "recompute", A2: "plain"}, None)
    assert _choose(program, pins) == {A1: "plain", A2: "plain", S: "recompute"}
    relaxed = _program(deterministic=False)
    assert _choose(relaxed, None)[A1] == "fast"
    assert _choose(relaxed, pin_requests(relaxed, {"attention": "plain"}, None)) == {
        A1: "plain",
        A2: "plain",
        S: "unrolled",
    }


def test_a_non_deterministic_request_is_refused_in_a_deterministic_run_only() -> None:
    with pytest.raises(PluginError) as caught:
        _choose(_program(), pin_requests(_program(), {"attention": "fast"}, None))
    assert str(caught.value) == (
        "--choose attention=fast: the attention kernel 'fast' is not deterministic and "
        "this run is (add :deterministic false to its defrun to take it)"
    )
    relaxed = _program(deterministic=False)
    assert _choose(relaxed, pin_requests(relaxed, {A1: "fast"}, None))[A1] == "fast"


@pytest.mark.parametrize("name", ["nope", "gpu-only", "elsewhere", "unrolled"])
def test_a_request_that_does_not_fit_lists_the_kernels_that_do(name: str) -> None:
    # another device's, another lowering's and another kind's kernel fit no more than none
    with pytest.raises(PluginError) as caught:
        _choose(_program(), pin_requests(_program(), {A1: name}, None))
    assert caught.value.exit_code == 1
    assert str(caught.value) == (
        f"--choose {A1}={name}: no attention kernel '{name}' for the toy lowering on cpu "
        "(kernels that fit: plain, fast (not deterministic); see `sexpgpu check`)"
    )


def test_a_recorded_pin_keeps_its_own_error() -> None:
    with pytest.raises(CheckpointError, match=r"^E-CHOICE-001: the recorded choice 'nope'"):
        _choose(_program(), {A1: "nope"})


def test_fresh_choices_drop_the_record_and_keep_the_requests() -> None:
    target = Target(choose={"stack": "recompute"}, fresh=True)
    choices = target.choices(_program(), {S: "unrolled", A1: "fast"})
    assert choices.pins() == {S: "recompute"}
    assert _choose(_program(), choices) == {A1: "plain", A2: "plain", S: "recompute"}

"""The conflict table and its helpers (sexpgpu.plugin_supplies), and what
Catalog.available / require hand out when two plugins claim one thing."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from sexpgpu.catalog import HOOK_NAMES, Catalog
from sexpgpu.errors import PluginError
from sexpgpu.extension import KernelInfo, OpInfo, OptimizerInfo, StorageBackendInfo
from sexpgpu.plugin_supplies import (
    COMMANDS_HOOK,
    SUPPLIES,
    conflict_message,
    exception_text,
    find_conflicts,
    nearest,
    refusing,
)
from sexpgpu_cli.describing import DESCRIBED

from .pluginkit import make_plugin


def test_every_hook_that_supplies_things_has_a_conflict_key_and_a_description() -> None:
    assert set(SUPPLIES) | {COMMANDS_HOOK, "sexpgpu_unavailable"} == set(HOOK_NAMES)
    assert set(DESCRIBED) == set(SUPPLIES)


def _kernel(name: str, lowering: str = "torch") -> KernelInfo:
    return KernelInfo("attention", name, lowering, ("cpu",), True, lambda: None)


def test_conflicts_are_between_plugins_and_by_key() -> None:
    claims = [
        (_kernel("math"), "torch", "sexpgpu 0.1.0"),
        (_kernel("math"), "torch", "sexpgpu 0.1.0"),  # one plugin twice: its own business
        (_kernel("fast"), "other", "other 1.0"),
        (_kernel("math", lowering="cuda-compiled"), "other", "other 1.0"),  # another lowering
    ]
    assert find_conflicts("sexpgpu_kernels", claims) == []
    claims.append((_kernel("math"), "twin", "twin 2.0"))
    (conflict,) = find_conflicts("sexpgpu_kernels", claims)
    assert conflict.what == "attention kernel 'math' of the torch lowering"
    assert conflict.owners == (("torch", "sexpgpu 0.1.0"), ("twin", "twin 2.0"))
    # a storage backend claims each of its schemes
    stores = [
        (StorageBackendInfo(("file", "mine"), str), "shadow", "shadow 0.1"),
        (StorageBackendInfo(("file",), str), "local", "sexpgpu 0.1.0"),
    ]
    assert [c.what for c in find_conflicts("sexpgpu_storage_backends", stores)] == [
        "storage scheme 'file'"
    ]
    assert find_conflicts("sexpgpu_no_such_hook", stores) == []


def test_the_message_keeps_the_projects_own_plugin() -> None:
    owners = [("aaa", "aaa 0.1"), ("local", "sexpgpu 0.1.0"), ("zzz", "zzz 3")]
    assert conflict_message("the storage scheme 'file'", owners) == (
        "E-PLUGIN-001: the storage scheme 'file' is supplied by more than one plugin: "
        "'aaa' (aaa 0.1), 'local' (sexpgpu's own plugin) and 'zzz' (zzz 3); "
        "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=aaa,zzz"
    )
    # among third parties only, the first is kept
    assert conflict_message("x", [("b", "b 1"), ("c", "c 1")]).endswith("SEXPGPU_DISABLE_PLUGINS=c")


def test_a_refusing_copy_raises_the_conflict_when_used() -> None:
    (conflict,) = find_conflicts(
        "sexpgpu_optimizers",
        [
            (OptimizerInfo("adam", {"lr": 0.1}, lambda o: ("m",), lambda: "UPDATE"), "a", "a 1"),
            (OptimizerInfo("adam", {"lr": 0.2}, lambda o: (), lambda: "UPDATE"), "b", "b 1"),
        ],
    )
    info = OptimizerInfo("adam", {"lr": 0.1}, lambda o: ("m",), lambda: "UPDATE", doc="d")
    copy = refusing(info, conflict)
    assert (copy.name, dict(copy.options), copy.doc) == ("adam", {"lr": 0.1}, "d")
    for call in (copy.factory, lambda: copy.state_names({})):
        with pytest.raises(PluginError) as caught:
            call()
        assert caught.value.code == "E-PLUGIN-001"
        assert str(caught.value).startswith("E-PLUGIN-001: the optimizer 'adam' is supplied by")
    assert info.factory() == "UPDATE", "the original is left as it was"
    # an op's implementation per lowering is refused too
    op = refusing(OpInfo("sq", spec=None, implementations={"torch": lambda: 1}), conflict)
    with pytest.raises(PluginError):
        op.implementations["torch"]()
    assert refusing("not a dataclass", conflict) == "not a dataclass"


def test_exception_text_keeps_every_line_and_the_cause() -> None:
    try:
        try:
            raise KeyError("region")
        except KeyError as exc:
            raise RuntimeError("cannot open\nthe store\n") from exc
    except RuntimeError as exc:
        assert exception_text(exc) == (
            "RuntimeError: cannot open | the store; caused by KeyError: 'region'"
        )
    try:
        try:
            raise OSError("hidden")
        except OSError:
            raise ValueError() from None
    except ValueError as exc:
        assert exception_text(exc) == "ValueError"
    try:
        try:
            raise OSError("while handling")
        except OSError:
            raise ValueError("second")  # noqa: B904 - an implicit cause is kept too
    except ValueError as exc:
        assert exception_text(exc) == "ValueError: second; caused by OSError: while handling"


def test_nearest() -> None:
    hooks = HOOK_NAMES
    assert nearest("sexpgpu_metric_sinks", hooks) == "sexpgpu_metrics_sinks"
    assert nearest("sexpgpu_kernel", hooks) == "sexpgpu_kernels"
    assert nearest("completely_else", hooks) is None


TWIN = """
from sexpgpu.extension import OptimizerInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_optimizers():
    return [
        OptimizerInfo("t-dup", {{"lr": {lr}}}, lambda options: (), lambda: "UPDATE {lr}"),
        OptimizerInfo("t-own-{lr}", {{}}, lambda options: (), lambda: "OWN {lr}"),
    ]
"""


@pytest.fixture
def twins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The catalog with two plugins both supplying optimizer ``t-dup``."""
    tag = uuid.uuid4().hex[:8]
    modules = [f"t_twin_a_{tag}", f"t_twin_b_{tag}"]
    for module, lr, name in zip(modules, (1, 2), ("twin-a", "twin-b"), strict=True):
        make_plugin(tmp_path / name, name, {module: TWIN.format(lr=lr)}, {name: module})
        monkeypatch.syspath_prepend(str(tmp_path / name))
    monkeypatch.delenv("SEXPGPU_DISABLE_PLUGINS", raising=False)
    yield Catalog.load()
    for module in modules:
        sys.modules.pop(module, None)


def test_available_hands_out_refusing_copies_and_require_refuses(twins) -> None:
    mine = [i for i in twins.available("sexpgpu_optimizers") if i.name.startswith("t-")]
    assert sorted(i.name for i in mine) == ["t-dup", "t-dup", "t-own-1", "t-own-2"]
    own = {i.name: i.factory() for i in mine if i.name.startswith("t-own")}
    assert own == {"t-own-1": "OWN 1", "t-own-2": "OWN 2"}
    for dup in (i for i in mine if i.name == "t-dup"):
        with pytest.raises(PluginError, match="E-PLUGIN-001: the optimizer 't-dup' is supplied"):
            dup.factory()
    with pytest.raises(PluginError) as caught:
        twins.require("sexpgpu_optimizers", "the optimizer 't-dup'", lambda i: i.name == "t-dup")
    assert str(caught.value) == (
        "E-PLUGIN-001: the optimizer 't-dup' is supplied by more than one plugin: "
        "'twin-a' (twin-a 0.1) and 'twin-b' (twin-b 0.1); "
        "disable all but one, e.g. SEXPGPU_DISABLE_PLUGINS=twin-b"
    )
    assert [c.what for c in twins.conflicts()] == ["optimizer 't-dup'"]

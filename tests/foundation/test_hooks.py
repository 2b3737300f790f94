"""Each hook, answered by a third-party plugin found through a real dist-info on
sys.path, reaches the core through the catalog (sexpgpu.catalog) as documented in
docs/plugins.md."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sexpgpu.catalog import Catalog
from sexpgpu.errors import PluginError, SexpError
from sexpgpu.extension import (
    DataSourceInfo,
    KernelInfo,
    LoweringInfo,
    MetricsSinkInfo,
    OptimizerInfo,
    StorageBackendInfo,
    module_missing,
)
from sexpgpu_cli.plugin_commands import add_commands

from .pluginkit import make_plugin

# Every factory below records that it ran, so the tests can prove descriptors are
# lazy: asking a plugin for its descriptors runs no factory.
ALL_HOOKS = '''
from sexpgpu.extension import (
    DataSourceInfo, KernelInfo, LoweringInfo, MetricsSinkInfo, OptimizerInfo,
    StorageBackendInfo,
)
from sexpgpu.lang.ir import TensorType
from sexpgpu.hookspecs import hookimpl

CALLED = []


def _factory(what, result):
    def factory(*args):
        CALLED.append((what, args))
        return result
    return factory


class Sink:
    def __init__(self):
        self.events = []
        self.closed = False

    def write(self, events):
        self.events.extend(events)

    def close(self):
        self.closed = True


@hookimpl
def sexpgpu_lowerings():
    return [LoweringInfo("t-lowering", ("cpu",), _factory("lowering", "LOWERING"), doc="test")]


@hookimpl
def sexpgpu_kernels():
    return [
        KernelInfo("attention", "t-fast", "t-lowering", ("cuda",), False,
                   _factory("kernel", "FAST"), priority=9),
        KernelInfo("attention", "t-exact", "t-lowering", ("cpu", "cuda"), True,
                   _factory("kernel", "EXACT")),
    ]


@hookimpl
def sexpgpu_optimizers():
    return [OptimizerInfo(
        "t-adam", {"lr": 0.001, "beta1": 0.9},
        lambda options: ("m", "v"), _factory("optimizer", "UPDATE"),
    )]


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(("tmem", "tmem2"), _factory("storage", "STORAGE"))]


@hookimpl
def sexpgpu_metrics_sinks():
    return [MetricsSinkInfo("t-sink", lambda folder, slug: Sink())]


@hookimpl
def sexpgpu_data_sources():
    return [DataSourceInfo(
        "t-counting", {"start": 0},
        lambda options, seq, batch: {"inputs": TensorType((batch, seq), "i64")},
        _factory("data", "LOADER"),
    )]


@hookimpl
def sexpgpu_cli_commands(cli):
    import click

    @click.command("t-hello")
    def hello():
        """Say hello (a test command)."""
        click.echo("hello from a plugin")

    cli.add_command(hello)
'''

UNAVAILABLE = """
from sexpgpu.extension import StorageBackendInfo, module_missing
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_unavailable():
    return module_missing("no_such_module_xyz", "pip install 'sexpgpu-tnodep[all]'")


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(("tnodep",), lambda uri: 1 / 0)]
"""


@pytest.fixture
def loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The catalog with two third-party plugins installed on sys.path."""
    tag = uuid.uuid4().hex[:8]
    modules = {"allhooks": f"t_allhooks_{tag}", "nodep": f"t_nodep_{tag}"}
    make_plugin(
        tmp_path, "t-allhooks", {modules["allhooks"]: ALL_HOOKS}, {"tall": modules["allhooks"]}
    )
    make_plugin(
        tmp_path / "other", "t-nodep", {modules["nodep"]: UNAVAILABLE}, {"tnodep": modules["nodep"]}
    )
    for variable in ("SEXPGPU_DISABLE_PLUGINS", "SEXPGPU_TRACE_PLUGINS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "other"))
    yield Catalog.load()
    for module in modules.values():
        sys.modules.pop(module, None)


def _module(plugins):
    """The loaded module of the all-hooks plugin (to read what its factories recorded)."""
    return plugins.record("tall").plugin


def test_records_list_every_hook(loaded) -> None:
    plugins = loaded
    record = plugins.record("tall")
    assert record is not None and record.available, record
    assert record.distribution == "t-allhooks" and record.version == "0.1"
    assert record.hooks == [
        "sexpgpu_cli_commands",
        "sexpgpu_data_sources",
        "sexpgpu_kernels",
        "sexpgpu_lowerings",
        "sexpgpu_metrics_sinks",
        "sexpgpu_optimizers",
        "sexpgpu_storage_backends",
    ]
    assert plugins.record("no-such-plugin") is None


def test_sexpgpu_lowerings(loaded) -> None:
    plugins = loaded
    info = plugins.require("sexpgpu_lowerings", "a test lowering", lambda i: i.name == "t-lowering")
    assert isinstance(info, LoweringInfo) and info.devices == ("cpu",)
    assert _module(loaded).CALLED == []  # describing a lowering builds nothing
    assert info.factory() == "LOWERING"
    assert _module(loaded).CALLED == [("lowering", ())]


def test_sexpgpu_kernels(loaded) -> None:
    plugins = loaded
    kernels = [k for k in plugins.available("sexpgpu_kernels") if k.lowering == "t-lowering"]
    assert all(isinstance(k, KernelInfo) for k in kernels)
    assert [(k.name, k.deterministic, k.priority) for k in kernels] == [
        ("t-fast", False, 9),
        ("t-exact", True, 0),
    ]
    # the documented rule, applied to what the plugin supplies: on cpu only t-exact fits;
    # on cuda the deterministic one still wins over the higher-priority fast one
    for device in ("cpu", "cuda"):
        fitting = [k for k in kernels if device in k.devices and k.deterministic]
        best = sorted(fitting, key=lambda k: (-k.priority, k.name))[0]
        assert best.name == "t-exact"
    assert _module(loaded).CALLED == []


def test_sexpgpu_optimizers(loaded) -> None:
    plugins = loaded
    info = plugins.require("sexpgpu_optimizers", "optimizer 't-adam'", lambda i: i.name == "t-adam")
    assert isinstance(info, OptimizerInfo)
    assert dict(info.options) == {"lr": 0.001, "beta1": 0.9}
    assert info.state_names(info.options) == ("m", "v")
    with pytest.raises(PluginError, match="no installed plugin supplies optimizer 't-nope'"):
        plugins.require("sexpgpu_optimizers", "optimizer 't-nope'", lambda i: i.name == "t-nope")


def test_sexpgpu_storage_backends(loaded) -> None:
    plugins = loaded
    infos = [i for i in plugins.available("sexpgpu_storage_backends") if "tmem" in i.schemes]
    assert len(infos) == 1 and isinstance(infos[0], StorageBackendInfo)
    opened = plugins.open_location("tmem2://bucket/x")
    # the factory's object, with the Storage protocol's defaults for what it lacks
    assert opened.capitalize() == "Storage" and opened.takes_crc32c is False
    assert _module(loaded).CALLED == [("storage", ("tmem2://bucket/x",))]


def test_sexpgpu_metrics_sinks(loaded, tmp_path: Path) -> None:
    plugins = loaded
    info = plugins.require(
        "sexpgpu_metrics_sinks", "metrics sink 't-sink'", lambda i: i.name == "t-sink"
    )
    assert isinstance(info, MetricsSinkInfo)
    sink = info.factory(str(tmp_path), "my-run")
    sink.write([{"step": 1, "name": "loss", "value": 2.5}])
    sink.close()
    assert sink.events == [{"step": 1, "name": "loss", "value": 2.5}] and sink.closed


def test_sexpgpu_data_sources(loaded) -> None:
    plugins = loaded
    info = plugins.require(
        "sexpgpu_data_sources", "data 't-counting'", lambda i: i.name == "t-counting"
    )
    assert isinstance(info, DataSourceInfo)
    assert info.tokens_field == "inputs"
    fields = info.fields(info.options, 32, 4)
    assert list(fields) == ["inputs"]
    assert _module(loaded).CALLED == []  # shapes come without opening the data
    assert info.factory(info.options, 32, 4, 7) == "LOADER"


def test_sexpgpu_cli_commands(loaded) -> None:
    plugins = loaded

    @click.group()
    def root() -> None:
        """A root group standing in for the sexpgpu CLI."""

    add_commands(plugins, root)
    assert "t-hello" in root.commands
    # the unavailable plugin supplies no command and is not asked
    result = CliRunner().invoke(root, ["t-hello"])
    assert result.exit_code == 0 and result.output == "hello from a plugin\n"


def test_sexpgpu_unavailable(loaded) -> None:
    plugins = loaded
    record = plugins.record("tnodep")
    assert not record.available and not record.disabled
    assert record.reason == "no_such_module_xyz is not installed: pip install 'sexpgpu-tnodep[all]'"
    assert record.hooks == ["sexpgpu_storage_backends", "sexpgpu_unavailable"]
    # its descriptors are still visible (to explain), never handed out
    assert not any("tnodep" in i.schemes for i in plugins.available("sexpgpu_storage_backends"))
    with pytest.raises(PluginError) as caught:
        plugins.open_location("tnodep://x")
    assert isinstance(caught.value, SexpError)
    assert str(caught.value) == (
        "the location tnodep://x (tnodep://) needs the plugin 'tnodep', which is unavailable: "
        "no_such_module_xyz is not installed: pip install 'sexpgpu-tnodep[all]'"
    )


def test_module_missing_never_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """module_missing finds modules without importing them, and honours a blocked one."""
    assert module_missing("json", "hint") is None
    assert module_missing("no_such_module_xyz", "pip install x") == (
        "no_such_module_xyz is not installed: pip install x"
    )
    assert module_missing("no_such_pkg_xyz.sub", "h") == ("no_such_pkg_xyz.sub is not installed: h")
    monkeypatch.setitem(sys.modules, "json", None)  # how Python marks a module unimportable
    assert module_missing("json", "h") == "json is not installed: h"

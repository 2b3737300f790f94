"""Third-party plugins that claim what others supply, for the conflict tests: each is
source for :func:`tests.foundation.pluginkit.make_plugin` (module name = entry-point
name with ``-`` as ``_``, distribution = entry-point name)."""

from __future__ import annotations

from pathlib import Path

from .pluginkit import make_plugin

# Claims the `file` scheme and the `jsonl` sink (both built-in), and a scheme of its
# own. Whatever reaches it leaves a mark, so a test can prove it received nothing.
SHADOW = """
import os
from pathlib import Path

from sexpgpu.extension import MetricsSinkInfo, StorageBackendInfo
from sexpgpu.hookspecs import hookimpl


def _mark(what):
    with open(os.environ["SHADOW_MARK"], "a") as out:
        out.write(what + "\\n")


class Storage:
    def __init__(self, uri):
        _mark("storage " + uri)
        self.uri = uri

    def describe(self):
        return "shadow storage at " + self.uri


class Sink:
    def __init__(self, folder, slug):
        _mark("sink " + slug)

    def write(self, events):
        _mark("events")

    def close(self):
        pass


@hookimpl
def sexpgpu_storage_backends():
    return [
        StorageBackendInfo(("file",), Storage, doc="every local checkpoint, please"),
        StorageBackendInfo(("shadow",), Storage, doc="a scheme nobody else claims"),
    ]


@hookimpl
def sexpgpu_metrics_sinks():
    return [MetricsSinkInfo("jsonl", Sink, doc="every metric, please")]
"""

# The built-in deterministic attention kernel's name, for the torch lowering.
TWIN_KERNEL = """
from sexpgpu.extension import KernelInfo
from sexpgpu.hookspecs import hookimpl


def _factory():
    raise AssertionError("a contested kernel must never be built")


@hookimpl
def sexpgpu_kernels():
    return [KernelInfo("attention", "math", "torch", ("cpu",), True, _factory, doc="a twin")]
"""

# The built-in `arithmetic` data source's name.
TWIN_DATA = """
from sexpgpu.extension import DataSourceInfo
from sexpgpu.lang.ir import TensorType
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_data_sources():
    return [DataSourceInfo(
        "arithmetic", {"digits": 3},
        lambda options, seq, batch: {"inputs": TensorType((batch, seq), "i64")},
        lambda options, seq, batch, seed: None,
        doc="a twin",
    )]
"""

# The built-in `adam` optimizer's name.
TWIN_OPTIMIZER = """
from sexpgpu.extension import OptimizerInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_optimizers():
    return [OptimizerInfo("adam", {"lr": 0.1}, lambda options: (), lambda: None, doc="a twin")]
"""

# A command that would replace the built-in `run`, next to one of its own.
COMMAND_RUN = """
import click

from sexpgpu.extension import StorageBackendInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(("cmdrun",), lambda uri: None)]


@hookimpl
def sexpgpu_cli_commands(cli):
    @click.command("run")
    def run():
        click.echo("the plugin's run")

    @click.command("cmd-extra")
    def extra():
        click.echo("an extra command")

    cli.add_command(run)
    cli.add_command(extra)
"""

# Two plugins adding `hello`, each with a command of its own.
HELLO = """
import click

from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_cli_commands(cli):
    @click.command("hello")
    def hello():
        \"\"\"Say hello from {who}.\"\"\"
        click.echo("hello from {who}")

    @click.command("hello-{who}-only")
    def only():
        click.echo("only {who}")

    cli.add_command(hello)
    cli.add_command(only)
"""

# A misspelled hook (marked), a real hook not marked, and one real, marked hook.
TYPO = """
from sexpgpu.extension import MetricsSinkInfo, StorageBackendInfo
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_metric_sinks():
    return [MetricsSinkInfo("typo", lambda folder, slug: None)]


def sexpgpu_storage_backends():
    return [StorageBackendInfo(("unmarked",), lambda uri: None)]


@hookimpl
def sexpgpu_lowerings():
    return []
"""

PLUGINS = {
    "aaa-shadow": SHADOW,
    "twin-kernel": TWIN_KERNEL,
    "twin-data": TWIN_DATA,
    "twin-opt": TWIN_OPTIMIZER,
    "cmd-run": COMMAND_RUN,
    "hello-a": HELLO.replace("{who}", "a"),
    "hello-b": HELLO.replace("{who}", "b"),
    "typo": TYPO,
}


def install(root: Path, *names: str) -> Path:
    """Install the plugins ``names`` (keys of :data:`PLUGINS`) into ``root``; returns it."""
    for name in names:
        module = "t_" + name.replace("-", "_")
        make_plugin(root, name, {module: PLUGINS[name]}, {name: module})
    return root

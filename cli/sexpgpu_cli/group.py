"""The root ``sexpgpu`` group: built-in commands load lazily, plugins add theirs.

Imported by :func:`sexpgpu_cli.main.main` once the signals are taken, since
click and the plugins take a noticeable part of start-up. The command line is
where the :class:`sexpgpu.catalog.Catalog` is built, once per invocation, and
handed to every command as click's context object (:func:`catalog`; a plugin's
command takes it with ``click.get_current_context().find_object(Catalog)``).
"""

from __future__ import annotations

import importlib
import importlib.util

import click

from sexpgpu import __version__
from sexpgpu.catalog import Catalog
from sexpgpu.errors import SexpError, SourceError, UsageError
from sexpgpu_cli.commands import BUILTIN_COMMANDS


class LazyGroup(click.Group):
    """A click group whose built-in commands are imported on first use."""

    invoked: str | None = None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *(n for n in BUILTIN_COMMANDS if _present(n))})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        # A built-in name always means the built-in: plugins never replace one
        # (plugin_commands.add_commands refuses them; this makes it hold regardless).
        target = BUILTIN_COMMANDS.get(cmd_name)
        if target is None:
            return self.commands.get(cmd_name)
        if not _present(cmd_name):
            return None
        if cmd_name not in _loaded:
            module_name, attr = target.split(":")
            _loaded[cmd_name] = getattr(importlib.import_module(module_name), attr)
        return _loaded[cmd_name]

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        LazyGroup.invoked = name
        return name, command, rest


_loaded: dict[str, click.Command] = {}
"""The built-in commands imported so far."""


def _present(cmd_name: str) -> bool:
    module_name = BUILTIN_COMMANDS[cmd_name].split(":")[0]
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        return False


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="sexpgpu")
@click.option(
    "--log-format",
    type=click.Choice(["auto", "console", "json"]),
    default="auto",
    envvar="SEXPGPU_LOG_FORMAT",
    show_default=True,
    help="Log lines for people (console), machines (json), or by terminal (auto). "
    "Also accepted after the command.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    envvar="SEXPGPU_LOG_LEVEL",
    show_default=True,
    help="The least important log lines to show. Also accepted after the command.",
)
def cli(log_format: str, log_level: str) -> None:
    """Train neural networks described in .sx files, and never lose a run.

    \b
    Quick start:
      sexpgpu check examples/tiny-lm.sx
      sexpgpu run examples/tiny-lm.sx --checkpoint-dir ckpt --resume latest
    """
    from sexpgpu import log
    from sexpgpu_cli.logstream import LogStream

    log.configure(level=log_level, fmt=log_format, stream=LogStream())
    from sexpgpu.log import get_logger

    for warning in catalog().warnings:  # mistakes in the environment, said by every command
        get_logger("sexpgpu.plugins").warning(warning)


def catalog() -> Catalog:
    """The catalog of the command being run (built by :func:`invoke`)."""
    found = click.get_current_context().find_object(Catalog)
    assert found is not None, "a command runs under invoke(), which hands the catalog in"
    return found


def build_cli(plugins: Catalog) -> click.Group:
    """The root group with every available plugin's commands added (never over a
    built-in one: such a plugin is listed refused by ``sexpgpu plugins``, as is one
    whose ``run`` option would replace one of the command's own)."""
    from sexpgpu_cli.plugin_commands import add_commands
    from sexpgpu_cli.run_options import refuse_takeovers

    add_commands(plugins, cli, reserved=BUILTIN_COMMANDS)
    run = cli.get_command(click.Context(cli), "run")  # loaded as the group loads it
    if run is not None:
        refuse_takeovers(plugins, run)
    return cli


def invoke(args: list[str]) -> int | str | None:
    """Run the command ``args`` name; returns the exit status (``sys.exit``'s argument).

    Errors a user can cause (:class:`sexpgpu.errors.SexpError`) print one line and
    give their code; a `.sx` error line starts with file:line:col so editors can
    jump to it. Anything else is a bug and keeps its traceback.
    """
    plugins = Catalog.load()
    group = build_cli(plugins)
    try:
        group.main(args=args, prog_name="sexpgpu", standalone_mode=False, obj=plugins)
    except SystemExit as exc:
        return exc.code
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):
            raise KeyboardInterrupt from exc
        click.echo("Aborted!", err=True)
        return 1
    except click.BadParameter as exc:
        # a value of the wrong kind is one line, as our own usage errors are; only an
        # unknown option (click's NoSuchOption) shows the usage above its line
        said = UsageError(exc.format_message())
        click.echo(error_line(said), err=True)
        return said.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except SexpError as exc:
        click.echo(error_line(exc), err=True)
        return exc.exit_code
    except BrokenPipeError:
        return 0
    return 0


def error_line(exc: SexpError) -> str:
    """The one line printed for a user error: bare for `.sx` errors, else prefixed."""
    if isinstance(exc, SourceError) and exc.pos is not None:
        return str(exc)
    command = LazyGroup.invoked
    return f"sexpgpu {command}: {exc}" if command else f"sexpgpu: {exc}"

"""The root ``sexpgpu`` group: built-in commands load lazily, plugins add theirs.

Errors a user can cause (:class:`sexpgpu.errors.SexpError`) print one line and
exit with their code; a `.sx` error line starts with file:line:col so editors
can jump to it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click

from sexpgpu import __version__
from sexpgpu.errors import SexpError, SourceError

# name -> "module:attribute"; imported only when the command runs or --help lists it
BUILTIN_COMMANDS = {
    "run": "sexpgpu_cli.commands.run:run",
    "check": "sexpgpu_cli.commands.check:check",
    "compile": "sexpgpu_cli.commands.check:compile_",
    "checkpoint": "sexpgpu_cli.commands.checkpoint:checkpoint",
    "plugins": "sexpgpu_cli.commands.plugins:plugins",
}


class LazyGroup(click.Group):
    """A click group whose built-in commands are imported on first use."""

    invoked: str | None = None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *(n for n in BUILTIN_COMMANDS if _present(n))})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        # A built-in name always means the built-in: plugins never replace one
        # (Plugins.register_commands refuses them, this makes it hold regardless).
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
    help="Log lines for people (console), machines (json), or by terminal (auto).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    envvar="SEXPGPU_LOG_LEVEL",
    show_default=True,
    help="The least important log lines to show.",
)
def cli(log_format: str, log_level: str) -> None:
    """Train neural networks described in .sx files, and never lose a run.

    \b
    Quick start:
      sexpgpu check examples/tiny-lm.sx
      sexpgpu run examples/tiny-lm.sx --checkpoint-dir ckpt --resume latest
    """
    from sexpgpu import log
    from sexpgpu.plugins import get_plugins

    log.configure(level=log_level, fmt=log_format)
    get_plugins().log_warnings()


def build_cli() -> click.Group:
    """The root group with every available plugin's commands added (never over a
    built-in one: such a plugin is listed unavailable by ``sexpgpu plugins``)."""
    from sexpgpu.plugins import get_plugins

    get_plugins().register_commands(cli, reserved=BUILTIN_COMMANDS)
    return cli


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    group = build_cli()
    try:
        group.main(args=argv, prog_name="sexpgpu", standalone_mode=False)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):
            _interrupted_at_start_up()
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except SexpError as exc:
        click.echo(error_line(exc), err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        _interrupted_at_start_up()
    except BrokenPipeError:
        sys.exit(0)


def _interrupted_at_start_up() -> None:
    """Ctrl-C before a command installed its own handling (during start-up)."""
    command = LazyGroup.invoked
    prefix = f"sexpgpu {command}" if command else "sexpgpu"
    suffix = " at step 0" if command == "run" else ""
    click.echo(f"{prefix}: interrupted by SIGINT{suffix}", err=True)
    sys.exit(130)


def error_line(exc: SexpError) -> str:
    """The one line printed for a user error: bare for `.sx` errors, else prefixed."""
    if isinstance(exc, SourceError) and exc.pos is not None:
        return str(exc)
    command = LazyGroup.invoked
    return f"sexpgpu {command}: {exc}" if command else f"sexpgpu: {exc}"

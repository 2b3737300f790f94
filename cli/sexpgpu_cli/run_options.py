"""The options plugins add to ``sexpgpu run`` (hook ``sexpgpu_run_options``), as pytest
plugins add theirs: each requests a recorded choice (``--threads 2``: ``cpu.threads=2``).

They become click options only when ``run`` parses its command line or shows its
help (:class:`RunCommand`), from the catalog of that invocation: the CLI names no
plugin's setting. A flag two plugins supply is added once, refusing when given
(``E-PLUGIN-001``), as is the flag of a plugin that is unavailable (its reason);
a plugin whose option would replace one of the command's own is refused as the CLI
starts (:func:`refuse_takeovers`), as a command over a built-in one is.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import click

from sexpgpu.catalog import Catalog
from sexpgpu.errors import SexpError
from sexpgpu.extension import RunOptionInfo
from sexpgpu.lang.contracts import FLAG

HOOK = "sexpgpu_run_options"
_CACHE = "sexpgpu_cli.run_options"
"""Where an invocation keeps its plugin options (``click.Context.meta``): built once."""


class RequestOption(click.Option):
    """A plugin's option: its value requests the recorded choice ``info.choice``; with
    ``refusal`` instead (contested, or its plugin unavailable) it takes any text and
    raises the refusal when given."""

    def __init__(self, flag: str, info: RunOptionInfo | None, refusal: SexpError | None):
        self.info, self.refusal = info, refusal
        super().__init__(
            [flag, "plugin_" + flag[2:].replace("-", "_")],  # never a built-in's name
            type=_type(info),
            help=info.help if info is not None else str(refusal),
            callback=self._refuse,
        )

    def _refuse(self, ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and self.refusal is not None and not ctx.resilient_parsing:
            raise self.refusal
        return value


def _type(info: RunOptionInfo | None) -> click.ParamType:
    if info is not None and info.values:
        return click.Choice(list(info.values))
    if info is not None and info.minimum is not None:
        return click.IntRange(min=info.minimum)
    return click.STRING


def own_flags(command: click.Command, ctx: click.Context | None = None) -> set[str]:
    """The flags ``command`` has of its own (its help option's included)."""
    flags = {flag for param in command.params for flag in (*param.opts, *param.secondary_opts)}
    names = command.get_help_option_names(ctx) if ctx is not None else {"--help"}
    return flags | set(names) | {"-h"}


def refuse_takeovers(catalog: Catalog, command: click.Command) -> None:
    """Refuse every plugin with an option named like one of ``command``'s own: the
    built-in always wins, and the plugin is listed refused, as for a command."""
    reserved = own_flags(command)
    for info, record in catalog.supplied(HOOK):
        if isinstance(info.flag, str) and info.flag in reserved:
            catalog.refuse(record, f"its run option '{info.flag}' would replace the built-in one")


def plugin_options(catalog: Catalog | None, reserved: Collection[str]) -> list[RequestOption]:
    """One option per flag the plugins of ``catalog`` supply, in their order, but those
    in ``reserved`` and those no command line can give (their plugin is refused)."""
    if catalog is None:  # a command made without the CLI (a test): its own options only
        return []
    written = (info.flag for info, _ in catalog.supplied(HOOK) if isinstance(info.flag, str))
    options = []
    for flag in dict.fromkeys(written):
        if not FLAG.fullmatch(flag) or flag in reserved:
            continue
        try:
            info = catalog.require(HOOK, f"the run option '{flag}'", lambda i, f=flag: i.flag == f)
            options.append(RequestOption(flag, info, None))
        except SexpError as refusal:
            options.append(RequestOption(flag, None, refusal))
    return options


class RunCommand(click.Command):
    """``sexpgpu run``: its own options, then those the plugins add (:func:`plugin_options`)."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        if _CACHE not in ctx.meta:
            catalog = ctx.find_object(Catalog)
            ctx.meta[_CACHE] = plugin_options(catalog, own_flags(self, ctx))
        params = super().get_params(ctx)
        mine = len(self.params)  # the help option comes last, after the plugins'
        return [*params[:mine], *ctx.meta[_CACHE], *params[mine:]]


def requested(
    ctx: click.Context, values: Mapping[str, Any]
) -> tuple[dict[str, str], dict[str, str]]:
    """From the plugin options' ``values`` (click's, by parameter name): the choices
    requested (``{"cpu.threads": "2"}``) and the flag naming each (``{"cpu.threads":
    "--threads"}``, the one given when two request it), a ``Target``'s ``requests``
    and ``options``."""
    usable = [
        (param.name, param.info)
        for param in ctx.command.get_params(ctx)
        if isinstance(param, RequestOption) and param.info is not None
    ]
    given = [(info, values[name]) for name, info in usable if values.get(name) is not None]
    flags = {info.choice: info.flag for info in (*(i for _, i in usable), *(i for i, _ in given))}
    return {info.choice: str(value) for info, value in given}, flags

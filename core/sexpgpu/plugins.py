"""Finding, loading and asking plugins.

Plugins are the modules named by entry points in the group ``sexpgpu``. Our own
built-in plugins are found the same way. A plugin that fails to import is kept
as a record with its reason, so ``sexpgpu plugins`` can say why, and nothing
that does not need it breaks. Two plugins supplying the same thing is a
conflict: the contested thing is refused (``E-PLUGIN-001``), never given to
whichever loaded first (see :mod:`sexpgpu.plugin_supplies`).

Environment variables: ``SEXPGPU_DISABLE_PLUGINS=a,b`` skips plugins by
entry-point name; ``SEXPGPU_DISABLE_DISTRIBUTIONS=x,y`` skips every plugin of
those distributions; ``SEXPGPU_TRACE_PLUGINS=1`` logs every hook call and keeps
the traceback of a plugin that failed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from sexpgpu import hookspecs
from sexpgpu.errors import PluginError
from sexpgpu.extension import module_missing  # noqa: F401 - kept importable from here
from sexpgpu.plugin_supplies import (
    COMMANDS_HOOK,
    DISABLE_PLUGINS,
    SUPPLIES,
    Conflict,
    contested_keys,
    describe,
    exception_text,
    find_conflicts,
    nearest,
    refusing,
    traceback_text,
)

ENTRY_POINT_GROUP = "sexpgpu"
DISABLE_DISTRIBUTIONS = "SEXPGPU_DISABLE_DISTRIBUTIONS"
TRACE_PLUGINS = "SEXPGPU_TRACE_PLUGINS"
HOOK_NAMES = frozenset(
    name for name, obj in vars(hookspecs).items() if hasattr(obj, f"{hookspecs.PROJECT}_spec")
)
"""Every hook a plugin may implement."""


@dataclass
class PluginRecord:
    """One plugin as found: where it came from, what it implements, whether it works here."""

    name: str
    module: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)
    available: bool = True
    reason: str | None = None
    disabled: bool = False
    plugin: ModuleType | None = None
    warnings: list[str] = field(default_factory=list)
    """Mistakes that do not stop the plugin (a misspelled hook), one line each."""
    traceback: str | None = None
    """The failure's traceback, kept under ``SEXPGPU_TRACE_PLUGINS`` only."""
    commands: dict[str, str] = field(default_factory=dict)
    """The CLI commands it adds, with their help line (known once the CLI starts)."""

    @property
    def where(self) -> str:
        """``distribution version``, as messages name a plugin's origin."""
        return f"{self.distribution} {self.version}"

    def as_json(self) -> dict[str, Any]:
        """The record as ``sexpgpu plugins --json`` prints it (without what it supplies)."""
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "version": self.version,
            "hooks": self.hooks,
            "available": self.available,
            "disabled": self.disabled,
            "reason": self.reason,
            "warnings": self.warnings,
            "traceback": self.traceback,
        }


class Plugins:
    """The loaded plugins and a typed way to ask them for things."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self.warnings: list[str] = []
        """Mistakes in the environment (a disabled name that matches nothing)."""
        self.command_conflicts: list[Conflict] = []
        self.tracing = os.environ.get(TRACE_PLUGINS, "").strip() not in ("", "0")
        self._warned = False
        if self.tracing:
            self._trace()
        self._load()

    # -- loading

    def _load(self) -> None:
        names = _listed(DISABLE_PLUGINS)
        distributions = {_normalized(d) for d in _listed(DISABLE_DISTRIBUTIONS)}

        def order(entry_point: metadata.EntryPoint) -> tuple[str, bool]:
            # by name; for a name two distributions register, one not disabled first
            return entry_point.name, _normalized(_distribution(entry_point)) in distributions

        for entry_point in sorted(_entry_points(), key=order):
            dist = getattr(entry_point, "dist", None)
            record = PluginRecord(
                name=entry_point.name,
                module=entry_point.value,
                distribution=_distribution(entry_point),
                version=dist.version if dist is not None else "?",
            )
            first = self.record(record.name)
            if first is not None:
                # the first on sys.path is the plugin, as for any entry point; said aloud
                self.warnings.append(
                    f"the plugin name '{record.name}' is registered by {first.where} "
                    f"({first.module}) and by {record.where} ({record.module}); "
                    f"only the first is loaded"
                )
                continue
            self.records.append(record)
            disabled_by = [
                variable
                for variable, hit in (
                    (DISABLE_PLUGINS, record.name in names),
                    (DISABLE_DISTRIBUTIONS, _normalized(record.distribution) in distributions),
                )
                if hit
            ]
            if disabled_by:
                record.available, record.disabled = False, True
                record.reason = f"disabled by {disabled_by[0]}"
                continue
            self._register(record, entry_point)
        # Only the plugin names warn: a distribution list is usually set by tooling
        # (the test suite) for processes whose sys.path may not hold them all.
        self._warn_unmatched(DISABLE_PLUGINS, names, [r.name for r in self.records])

    def _register(self, record: PluginRecord, entry_point: metadata.EntryPoint) -> None:
        try:
            plugin = entry_point.load()
            self.manager.register(plugin, name=entry_point.name)
        except Exception as exc:  # a broken plugin must never lock a user out
            self._fail(record, "failed to load", exc)
            return
        record.plugin = plugin
        implemented = {
            impl.function.__name__: caller.spec is not None
            for caller in self.manager.get_hookcallers(plugin) or []
            for impl in caller.get_hookimpls()
            if impl.plugin is plugin
        }
        record.hooks = sorted(name for name, specified in implemented.items() if specified)
        record.warnings = _hook_mistakes(plugin, implemented)
        if "sexpgpu_unavailable" in record.hooks:
            try:
                reason = next(iter(self._ask(record, "sexpgpu_unavailable")), None)
            except Exception as exc:
                self._fail(record, "availability check failed", exc)
                return
            if reason:
                record.available, record.reason = False, str(reason)

    def _fail(self, record: PluginRecord, what: str, exc: BaseException) -> None:
        """Mark ``record`` unavailable because of ``exc``, keeping its whole message."""
        record.available = False
        record.reason = f"{what}: {exception_text(exc)}"
        if self.tracing:
            record.traceback = traceback_text(exc)

    def _warn_unmatched(self, variable: str, names: Collection[str], known: list[str]) -> None:
        for name in names:
            if name in known:
                continue
            close = nearest(name, known)
            hint = f" (did you mean '{close}'?)" if close else ""
            self.warnings.append(f"{variable} names '{name}', which is no installed plugin{hint}")

    def log_warnings(self) -> None:
        """Log each warning about the environment once per process (the CLI calls
        this after it has set up logging)."""
        if self._warned:
            return
        self._warned = True
        if not self.warnings:
            return
        from sexpgpu.log import get_logger

        logger = get_logger("sexpgpu.plugins")
        for warning in self.warnings:
            logger.warning(warning)

    def _trace(self) -> None:
        from sexpgpu.log import get_logger

        logger = get_logger("sexpgpu.plugins")

        def before(hook_name: str, hook_impls: list, kwargs: dict) -> None:
            logger.info("hook call", hook=hook_name, plugins=[i.plugin_name for i in hook_impls])

        def after(outcome, hook_name: str, hook_impls: list, kwargs: dict) -> None:
            logger.info("hook done", hook=hook_name)

        self.manager.add_hookcall_monitoring(before, after)

    # -- asking

    def _ask(self, record: PluginRecord, hook: str, **kwargs: Any) -> list[Any]:
        """Call ``hook`` on one plugin only, through pluggy's relay (so argument
        matching and SEXPGPU_TRACE_PLUGINS apply); its non-None result in a list."""
        others = [p for p in self.manager.get_plugins() if p is not record.plugin]
        return self.manager.subset_hook_caller(hook, remove_plugins=others)(**kwargs)

    def record(self, name: str) -> PluginRecord | None:
        """The record of the plugin registered under ``name``, if any."""
        return next((r for r in self.records if r.name == name), None)

    def supplied(self, hook: str) -> Iterator[tuple[Any, PluginRecord]]:
        """Every descriptor that loaded plugins supply through ``hook``, with its plugin.

        Unavailable plugins are asked too (their descriptors are cheap), so that
        a lookup can say "this needs plugin X, which is unavailable because ..."
        instead of "unknown".
        """
        for record in self.records:
            if record.plugin is None:
                continue
            if hook not in record.hooks:
                continue
            try:
                items = next(iter(self._ask(record, hook)), None) or []
            except Exception as exc:  # one plugin's bug must not break every lookup
                self._fail(record, f"{hook} failed", exc)
                continue
            yield from ((item, record) for item in items)

    def _claims(self, hook: str) -> list[tuple[Any, PluginRecord]]:
        return [(item, record) for item, record in self.supplied(hook) if record.available]

    def available(self, hook: str) -> list[Any]:
        """The descriptors supplied through ``hook`` by available plugins.

        A descriptor two plugins both claim (see :func:`conflicts`) comes as a
        copy whose factories raise ``E-PLUGIN-001``: choosing among them still
        works, using the contested one fails with the conflict.
        """
        claims = self._claims(hook)
        found = find_conflicts(hook, ((i, r.name, r.where) for i, r in claims))
        handed: list[Any] = []
        for item, _ in claims:
            contested = contested_keys(hook, item, found)
            handed.append(refusing(item, contested[0]) if contested else item)
        return handed

    def require(self, hook: str, what: str, matches: Callable[[Any], bool]) -> Any:
        """The available descriptor from ``hook`` for which ``matches`` is true.

        Raises :class:`PluginError`: ``E-PLUGIN-001`` naming every plugin when
        more than one available plugin matches; naming ``what`` when none does,
        with that plugin's reason and install hint when only an unavailable one
        does.
        """
        matching = [(item, record) for item, record in self.supplied(hook) if matches(item)]
        usable = [(item, record) for item, record in matching if record.available]
        owners = {record.name: record.where for _, record in usable}
        if len(owners) > 1:
            raise Conflict(hook, what, tuple(owners.items())).error(what)
        if usable:
            return usable[0][0]
        if matching:
            record = matching[0][1]
            raise PluginError(
                f"{what} needs the plugin '{record.name}', which is unavailable: {record.reason}"
            )
        raise PluginError(f"no installed plugin supplies {what} (see `sexpgpu plugins`)")

    def conflicts(self) -> list[Conflict]:
        """Every conflict among available plugins: descriptors and CLI commands."""
        found: list[Conflict] = []
        for hook in SUPPLIES:
            claims = self._claims(hook)
            found.extend(find_conflicts(hook, ((i, r.name, r.where) for i, r in claims)))
        return found + self.command_conflicts

    def supplies(self, record: PluginRecord) -> dict[str, list[dict[str, Any]]]:
        """What ``record`` supplies, by hook (without the ``sexpgpu_`` prefix), described."""
        supplies: dict[str, list[dict[str, Any]]] = {}
        for hook in SUPPLIES:
            if record.plugin is None or hook not in record.hooks:
                continue
            try:
                items = next(iter(self._ask(record, hook)), None) or []
            except Exception as exc:
                self._fail(record, f"{hook} failed", exc)
                continue
            described = [d for d in (describe(hook, item) for item in items) if d is not None]
            supplies[hook.removeprefix("sexpgpu_")] = described
        if record.commands:
            supplies[COMMANDS_HOOK.removeprefix("sexpgpu_")] = [
                {"title": name, "name": name, "doc": doc} for name, doc in record.commands.items()
            ]
        return supplies

    # -- the command line

    def register_commands(self, cli: Any, reserved: Collection[str] = ()) -> None:
        """Let every available plugin add its CLI subcommands to ``cli``.

        Each plugin adds its commands to a group of its own first, so that what
        it adds is known before anything is replaced: a plugin adding a command
        named in ``reserved`` (the built-in ones) is made unavailable, and a
        command two plugins add is replaced by one that refuses with the
        conflict. A plugin whose hook raises is skipped.
        """
        import click

        claims: dict[str, list[tuple[PluginRecord, Any]]] = {}
        for record in self.records:
            if COMMANDS_HOOK not in record.hooks or not record.available:
                continue
            staging = click.Group(name=getattr(cli, "name", None))
            try:
                self._ask(record, COMMANDS_HOOK, cli=staging)
            except Exception as exc:
                self._fail(record, "adding its commands failed", exc)
                continue
            record.commands = {
                name: command.get_short_help_str(limit=100)
                for name, command in sorted(staging.commands.items())
            }
            taken = sorted(set(staging.commands) & set(reserved))
            if taken:
                record.available = False
                listed = ", ".join(f"'{name}'" for name in taken)
                record.reason = (
                    f"its command {listed} would replace the built-in one"
                    if len(taken) == 1
                    else f"its commands {listed} would replace the built-in ones"
                )
                continue
            for name, command in staging.commands.items():
                claims.setdefault(name, []).append((record, command))
        for name, owners in claims.items():
            if len(owners) == 1:
                cli.add_command(owners[0][1], name)
                continue
            conflict = Conflict(
                COMMANDS_HOOK, f"command '{name}'", tuple((r.name, r.where) for r, _ in owners)
            )
            self.command_conflicts.append(conflict)
            cli.add_command(_refusing_command(name, conflict), name)


def _refusing_command(name: str, conflict: Conflict) -> Any:
    """A command standing for ``name`` that two plugins add: it only refuses."""
    import click

    def refuse() -> None:
        raise conflict.error()

    return click.Command(
        name,
        callback=refuse,
        help=conflict.message(),
        short_help=f"refused: added by {' and '.join(conflict.plugins)} (see `sexpgpu plugins`)",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )


def _hook_mistakes(plugin: Any, implemented: dict[str, bool]) -> list[str]:
    """Warnings for functions that look like hooks but are never called: an unknown
    hook name (with the nearest one) or a hook function not marked ``@hookimpl``."""
    names = set(implemented)
    if isinstance(plugin, ModuleType):
        names |= {
            name
            for name, obj in vars(plugin).items()
            if name.startswith("sexpgpu_") and inspect.isfunction(obj)
        }
    warnings = []
    for name in sorted(names):
        if name in HOOK_NAMES and name in implemented:
            continue
        if name in HOOK_NAMES:
            warnings.append(f"{name} is not marked with @hookimpl, so it is never called")
            continue
        close = nearest(name, HOOK_NAMES)
        hint = f" (did you mean {close}?)" if close else ""
        warnings.append(f"{name} is not a sexpgpu hook, so it is never called{hint}")
    return warnings


def _listed(variable: str) -> list[str]:
    """The comma-separated names in an environment variable, in order, without blanks."""
    names = (name.strip() for name in os.environ.get(variable, "").split(","))
    return list(dict.fromkeys(name for name in names if name))


def _distribution(entry_point: metadata.EntryPoint) -> str:
    """The name of the distribution that registers ``entry_point`` (``?`` if unknown)."""
    dist = getattr(entry_point, "dist", None)
    return dist.metadata["Name"] if dist is not None else "?"


def _normalized(distribution: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


_plugins: Plugins | None = None


def get_plugins() -> Plugins:
    """The process-wide plugin set, loaded on first use."""
    global _plugins
    if _plugins is None:
        _plugins = Plugins()
    return _plugins


def reset_plugins() -> None:
    """Forget the loaded plugins (tests that change the environment use this)."""
    global _plugins
    _plugins = None
    importlib.invalidate_caches()

"""Finding, loading and asking plugins.

Plugins are the modules named by entry points in the group ``sexpgpu``. Our own
built-in plugins are found the same way. A plugin that fails to import is kept
as a record with its reason, so ``sexpgpu plugins`` can say why, and nothing
that does not need it breaks. ``SEXPGPU_DISABLE_PLUGINS=a,b`` skips plugins by
entry-point name; ``SEXPGPU_TRACE_PLUGINS=1`` logs every hook call.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from sexpgpu import hookspecs
from sexpgpu.errors import PluginError

ENTRY_POINT_GROUP = "sexpgpu"


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

    def as_json(self) -> dict[str, Any]:
        """The record as ``sexpgpu plugins --json`` prints it."""
        return {
            "name": self.name,
            "module": self.module,
            "distribution": self.distribution,
            "version": self.version,
            "hooks": self.hooks,
            "available": self.available,
            "disabled": self.disabled,
            "reason": self.reason,
        }


class Plugins:
    """The loaded plugins and a typed way to ask them for things."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self.tracing = os.environ.get("SEXPGPU_TRACE_PLUGINS", "").strip() not in ("", "0")
        if self.tracing:
            self._trace()
        self._load()

    # -- loading

    def _load(self) -> None:
        disabled = {
            name.strip()
            for name in os.environ.get("SEXPGPU_DISABLE_PLUGINS", "").split(",")
            if name.strip()
        }
        seen: set[str] = set()
        for entry_point in sorted(_entry_points(), key=lambda ep: ep.name):
            if entry_point.name in seen:
                continue
            seen.add(entry_point.name)
            dist = getattr(entry_point, "dist", None)
            record = PluginRecord(
                name=entry_point.name,
                module=entry_point.value,
                distribution=dist.metadata["Name"] if dist is not None else "?",
                version=dist.version if dist is not None else "?",
            )
            self.records.append(record)
            if entry_point.name in disabled:
                record.available, record.disabled = False, True
                record.reason = "disabled by SEXPGPU_DISABLE_PLUGINS"
                continue
            try:
                plugin = entry_point.load()
                self.manager.register(plugin, name=entry_point.name)
            except Exception as exc:  # a broken plugin must never lock a user out
                record.available = False
                record.reason = f"failed to load: {type(exc).__name__}: {exc}".splitlines()[0]
                continue
            record.plugin = plugin
            record.hooks = sorted(
                impl.function.__name__
                for caller in self.manager.get_hookcallers(plugin) or []
                for impl in caller.get_hookimpls()
                if impl.plugin is plugin
            )
            if "sexpgpu_unavailable" in record.hooks:
                try:
                    reason = next(iter(self._ask(record, "sexpgpu_unavailable")), None)
                except Exception as exc:
                    reason = f"availability check failed: {type(exc).__name__}: {exc}"
                if reason:
                    record.available, record.reason = False, str(reason)

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
                record.available = False
                record.reason = f"{hook} failed: {type(exc).__name__}: {exc}".splitlines()[0]
                continue
            yield from ((item, record) for item in items)

    def available(self, hook: str) -> list[Any]:
        """The descriptors supplied through ``hook`` by available plugins."""
        return [item for item, record in self.supplied(hook) if record.available]

    def require(self, hook: str, what: str, matches) -> Any:
        """The first available descriptor from ``hook`` for which ``matches`` is true.

        Raises :class:`PluginError` naming ``what`` and, when only an unavailable
        plugin supplies it, that plugin's reason and install hint.
        """
        unavailable: list[PluginRecord] = []
        for item, record in self.supplied(hook):
            if matches(item):
                if record.available:
                    return item
                unavailable.append(record)
        if unavailable:
            record = unavailable[0]
            raise PluginError(
                f"{what} needs the plugin '{record.name}', which is unavailable: {record.reason}"
            )
        raise PluginError(f"no installed plugin supplies {what} (see `sexpgpu plugins`)")

    def register_commands(self, cli: Any) -> None:
        """Let every available plugin add its CLI subcommands; a failing one is skipped."""
        for record in self.records:
            if "sexpgpu_cli_commands" not in record.hooks or not record.available:
                continue
            try:
                self._ask(record, "sexpgpu_cli_commands", cli=cli)
            except Exception as exc:
                record.available = False
                record.reason = f"adding its commands failed: {type(exc).__name__}: {exc}"


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


def module_missing(module: str, hint: str) -> str | None:
    """For ``sexpgpu_unavailable``: a reason with ``hint`` when ``module`` cannot be imported.

    Looks the module up without importing it, so checking stays cheap.
    """
    if sys.modules.get(module) is not None:  # None there means "blocked": missing
        return None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"{module} is not installed: {hint}"
    return None

"""The catalog: what the installed plugins supply, found once and handed to whatever
needs it (docs/plugins.md, "The catalog"). Only this module builds pluggy's manager.

A plugin that fails to import is kept unavailable with its reason; one whose answers
break their contract (:mod:`sexpgpu.lang.contracts`) is kept refused; a thing two
plugins supply is refused (``E-PLUGIN-001``, :mod:`sexpgpu.plugin_supplies`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from sexpgpu import __version__, hookspecs
from sexpgpu import extension as ext
from sexpgpu.errors import PluginError, StorageError
from sexpgpu.lang.contracts import HOOK_NAMES, held_to_contract, hook_mistakes
from sexpgpu.plugin_supplies import (
    DISABLE_PLUGINS,
    PROJECT_DISTRIBUTION,
    SUPPLIES,
    Conflict,
    contested_keys,
    exception_text,
    find_conflicts,
    nearest,
    refusing,
)

__all__ = ["ENTRY_POINT_GROUP", "HOOK_NAMES", "Catalog", "PluginRecord"]

ENTRY_POINT_GROUP = "sexpgpu"
DISABLE_DISTRIBUTIONS = "SEXPGPU_DISABLE_DISTRIBUTIONS"
TRACE_PLUGINS = "SEXPGPU_TRACE_PLUGINS"


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
    refused: bool = False  # unavailable for what it declares: its own mistake
    disabled: bool = False
    plugin: Any = None
    warnings: list[str] = field(default_factory=list)  # mistakes that do not stop it
    traceback: str | None = None  # the failure's, kept under SEXPGPU_TRACE_PLUGINS only
    commands: dict[str, str] = field(default_factory=dict)  # its CLI commands' help lines

    @property
    def where(self) -> str:
        """``distribution version``, as messages name a plugin's origin."""
        return f"{self.distribution} {self.version}"

    @property
    def state(self) -> str:
        """``available``, ``unavailable`` (it cannot work here) or ``refused``."""
        return "available" if self.available else "refused" if self.refused else "unavailable"


class Catalog:
    """The loaded plugins and what they supply, asked for by hook. Each supplying hook
    is asked once, when first needed: asking again would only repeat the answer."""

    def __init__(self) -> None:
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []  # in load order (by entry-point name)
        self.warnings: list[str] = []  # mistakes in the environment (a misspelled name)
        self.command_conflicts: list[Conflict] = []  # found by the CLI as it adds commands
        self._supplied: dict[str, list[tuple[Any, PluginRecord]]] = {}
        self._failed: set[tuple[str, str]] = set()  # (plugin, hook) whose hook raised
        self._tracing = os.environ.get(TRACE_PLUGINS, "").strip() not in ("", "0")
        if self._tracing:
            self._trace()

    # -- building

    @classmethod
    def load(cls) -> Catalog:
        """The plugins the entry-point group ``sexpgpu`` names, as the environment
        (``SEXPGPU_DISABLE_PLUGINS``, ``SEXPGPU_DISABLE_DISTRIBUTIONS``) allows."""
        importlib.invalidate_caches()  # a plugin installed since the last look is found
        catalog = cls()
        catalog._load_entry_points()
        return catalog

    @classmethod
    def of(cls, plugins: Mapping[str, Any], *, distribution: str = PROJECT_DISTRIBUTION) -> Catalog:
        """A catalog of ``plugins`` (name -> a module or object with ``@hookimpl``
        functions), registered as entry points would be, and nothing else."""
        catalog = cls()
        version = __version__ if distribution == PROJECT_DISTRIBUTION else "?"
        for name in sorted(plugins):
            plugin = plugins[name]
            module = getattr(plugin, "__name__", type(plugin).__name__)
            record = PluginRecord(name, module, distribution, version)
            catalog.records.append(record)
            catalog._register(record, lambda plugin=plugin: plugin)
        return catalog

    def _load_entry_points(self) -> None:
        names = _listed(DISABLE_PLUGINS)
        distributions = {_normalized(d) for d in _listed(DISABLE_DISTRIBUTIONS)}

        def order(entry_point: metadata.EntryPoint) -> tuple[str, bool]:
            # by name; for a name two distributions register, one not disabled first
            return entry_point.name, _normalized(_origin(entry_point)[0]) in distributions

        for entry_point in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=order):
            record = PluginRecord(entry_point.name, entry_point.value, *_origin(entry_point))
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
            if record.name in names or _normalized(record.distribution) in distributions:
                by = DISABLE_PLUGINS if record.name in names else DISABLE_DISTRIBUTIONS
                record.available, record.disabled, record.reason = False, True, f"disabled by {by}"
                continue
            self._register(record, entry_point.load)
        # Only the plugin names warn: a distribution list is usually set by tooling
        # (the test suite) for processes whose sys.path may not hold them all.
        known = [r.name for r in self.records]
        for name in (name for name in names if name not in known):
            hint = f" (did you mean '{close}'?)" if (close := nearest(name, known)) else ""
            said = f"{DISABLE_PLUGINS} names '{name}', which is no installed plugin{hint}"
            self.warnings.append(said)

    def _register(self, record: PluginRecord, load: Callable[[], Any]) -> None:
        try:
            plugin = load()
            self._manager.register(plugin, name=record.name)
        except Exception as exc:  # a broken plugin must never lock a user out
            self.fail(record, "failed to load", exc)
            return
        record.plugin = plugin
        implemented = {
            impl.function.__name__: caller.spec is not None
            for caller in self._manager.get_hookcallers(plugin) or []
            for impl in caller.get_hookimpls()
            if impl.plugin is plugin
        }
        record.hooks = sorted(name for name, specified in implemented.items() if specified)
        record.warnings = hook_mistakes(plugin, implemented)
        if "sexpgpu_unavailable" in record.hooks:
            try:
                reason = next(iter(self.ask(record, "sexpgpu_unavailable")), None)
            except Exception as exc:
                self.fail(record, "availability check failed", exc)
                return
            if reason:
                record.available, record.reason = False, str(reason)

    def fail(self, record: PluginRecord, what: str, exc: BaseException) -> None:
        """Mark ``record`` unavailable because of ``exc``, keeping its whole message."""
        record.available = False
        record.reason = f"{what}: {exception_text(exc)}"
        if self._tracing:
            record.traceback = "".join(traceback.format_exception(exc)).rstrip()

    def _trace(self) -> None:
        from sexpgpu.log import get_logger

        logger = get_logger("sexpgpu.plugins")

        def before(hook_name: str, hook_impls: list, kwargs: dict) -> None:
            logger.info("hook call", hook=hook_name, plugins=[i.plugin_name for i in hook_impls])

        def after(outcome: Any, hook_name: str, hook_impls: list, kwargs: dict) -> None:
            logger.info("hook done", hook=hook_name)

        self._manager.add_hookcall_monitoring(before, after)

    # -- asking

    def ask(self, record: PluginRecord, hook: str, **kwargs: Any) -> list[Any]:
        """Call ``hook`` on one plugin only, through pluggy's relay (so argument matching
        and tracing apply): what of its answer fits the contract, in a list."""
        others = [p for p in self._manager.get_plugins() if p is not record.plugin]
        answer = self._manager.subset_hook_caller(hook, remove_plugins=others)(**kwargs)
        fitting, problem = held_to_contract(hook, next(iter(answer), None))
        if problem:
            self.refuse(record, problem)
        return [] if fitting is None else [fitting]

    def refuse(self, record: PluginRecord, reason: str) -> None:
        """Refuse ``record`` for what it declares, unless it is unavailable already."""
        if record.available:
            record.available, record.refused, record.reason = False, True, reason

    def record(self, name: str) -> PluginRecord | None:
        """The record of the plugin registered under ``name``, if any."""
        return next((r for r in self.records if r.name == name), None)

    def supplied(self, hook: str) -> list[tuple[Any, PluginRecord]]:
        """Every descriptor loaded plugins supply through ``hook``, with its plugin;
        unavailable ones too, so that a lookup can say why a thing is missing."""
        if hook not in self._supplied:
            found: list[tuple[Any, PluginRecord]] = []
            for record in self.records:
                if record.plugin is None or hook not in record.hooks:
                    continue
                try:
                    items = next(iter(self.ask(record, hook)), None) or []
                except Exception as exc:  # one plugin's bug must not break every lookup
                    self.fail(record, f"{hook} failed", exc)
                    self._failed.add((record.name, hook))
                    continue
                found.extend((item, record) for item in items)
            self._supplied[hook] = found
        return list(self._supplied[hook])

    def _claims(self, hook: str) -> list[tuple[Any, PluginRecord]]:
        return [(item, record) for item, record in self.supplied(hook) if record.available]

    def available(self, hook: str) -> list[Any]:
        """The descriptors available plugins supply through ``hook``; a contested one
        as a copy whose factories raise ``E-PLUGIN-001``, so that choosing works."""
        found = self.conflicts(hook)
        contested = [(item, contested_keys(hook, item, found)) for item, _ in self._claims(hook)]
        return [refusing(item, against[0]) if against else item for item, against in contested]

    def require(self, hook: str, what: str, matches: Callable[[Any], bool]) -> Any:
        """The available descriptor from ``hook`` for which ``matches`` is true; else a
        :class:`PluginError` (``E-PLUGIN-001`` when several plugins have one)."""
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
                f"{what} needs the plugin '{record.name}', which is {record.state}: {record.reason}"
            )
        raise PluginError(f"no installed plugin supplies {what} (see `sexpgpu plugins`)")

    def named(self, hook: str, kind: str, name: str) -> Any:
        """The available descriptor of ``hook`` called ``name`` (a ``kind``, as in
        "metrics sink"); an unknown name is refused with every known one."""
        known = sorted({item.name for item, _ in self.supplied(hook)})
        if name not in known:
            hint = f" (did you mean '{close}'?)" if (close := nearest(name, known)) else ""
            raise PluginError(
                f"unknown {kind} '{name}'{hint}; {kind}s: {', '.join(known) or 'none'}"
                + self.disabled_hint()
            )
        return self.require(hook, f"the {kind} '{name}'", lambda item: item.name == name)

    def disabled_hint(self) -> str:
        """What to add to "unknown" when disabled plugins might have supplied the name."""
        disabled = sorted(r.name for r in self.records if r.disabled)
        if not disabled:
            return ""
        return f"; it may come from a plugin disabled by {DISABLE_PLUGINS}: {', '.join(disabled)}"

    def conflicts(self, hook: str | None = None) -> list[Conflict]:
        """Every conflict among available plugins (and the core's built-in ops): over
        what ``hook`` supplies, or over every descriptor and CLI command."""
        found: list[Conflict] = []
        for name in SUPPLIES if hook is None else (hook,):
            claims = self._claims(name)
            found.extend(find_conflicts(name, ((i, r.name, r.where) for i, r in claims)))
        return found + (self.command_conflicts if hook is None else [])

    def failed(self, record: PluginRecord, hook: str) -> bool:
        """Whether ``record``'s ``hook`` raised when it was asked."""
        return (record.name, hook) in self._failed

    # -- what the core takes, typed

    def lowerings(self) -> list[ext.LoweringInfo]:
        return self.available("sexpgpu_lowerings")

    def kernels(self) -> list[ext.KernelInfo]:
        return self.available("sexpgpu_kernels")

    def optimizers(self) -> dict[str, ext.OptimizerInfo]:
        """Every available optimizer, by name, with the plugin that supplies it."""
        hook = "sexpgpu_optimizers"
        owners = [record.name for _, record in self._claims(hook)]
        return {
            info.name: dataclasses.replace(info, plugin=owner)
            for info, owner in zip(self.available(hook), owners, strict=True)
        }

    def plugin_ops(self) -> list[ext.OpInfo]:
        """The new ops available plugins supply (not implementations of built-in ones)."""
        from sexpgpu.lang.ops import BUILTINS

        return [
            info
            for info in self.available("sexpgpu_ops")
            if info.spec is not None and BUILTINS.get(info.spec.name) is None
        ]

    def data_source(self, name: str) -> ext.DataSourceInfo:
        """The data source ``name`` (a ``defdata``'s source)."""
        return self.named("sexpgpu_data_sources", "data source", name)

    def evaluator(self) -> ext.EvaluatorInfo:
        """The eval-pass runner (one plugin supplies it)."""
        return self.require("sexpgpu_evaluators", "eval passes (:evals)", lambda item: True)

    def eval_metrics(self) -> dict[str, ext.EvalMetricInfo]:
        """Every available eval metric, by name."""
        return {info.name: info for info in self.available("sexpgpu_eval_metrics")}

    def metrics_sink(self, name: str) -> ext.MetricsSinkInfo:
        """The metrics sink ``name`` (``--metrics-sink``)."""
        return self.named("sexpgpu_metrics_sinks", "metrics sink", name)

    def source_opener(self, name: str) -> ext.SourceOpenerInfo | None:
        """The opener of the file ``name``, by its suffix; ``None`` for a `.sx` file."""
        openers = self.available("sexpgpu_source_openers")
        return next((info for info in openers if name.endswith(info.suffix)), None)

    def open_location(self, uri: str) -> ext.Storage:
        """Open ``uri`` with the storage backend that serves its scheme (a plain path
        is ``file``); a :class:`PluginError` when no available plugin serves it."""
        from sexpgpu.checkpoint.storage import scheme_of

        if not uri:
            raise StorageError("an empty checkpoint location was given")
        scheme = scheme_of(uri)
        backend = self.require(
            "sexpgpu_storage_backends",
            f"the location {uri} ({scheme}://)",
            lambda info: scheme in info.schemes,
        )
        return ext.with_defaults(backend.factory(uri), ext.Storage)


def _listed(variable: str) -> list[str]:
    """The comma-separated names in an environment variable, in order, without blanks."""
    names = (name.strip() for name in os.environ.get(variable, "").split(","))
    return list(dict.fromkeys(name for name in names if name))


def _origin(entry_point: metadata.EntryPoint) -> tuple[str, str]:
    """The name and version of the distribution that registers ``entry_point``."""
    dist = getattr(entry_point, "dist", None)
    return (dist.metadata["Name"], dist.version) if dist is not None else ("?", "?")


def _normalized(distribution: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()

"""The catalog: what the installed plugins supply, found once and handed to whatever needs it.

Plugins are the modules the entry points of group ``sexpgpu`` name, ours included.
:meth:`Catalog.load` finds and loads them; :meth:`Catalog.of` builds a catalog of
modules in hand (a test, a tool). Only this module builds pluggy's manager: the
compiler, the session, storage and metrics are given a catalog, never fetch one.

A plugin that fails to import is kept unavailable with its reason for ``sexpgpu
plugins``; one whose hook answers with another type than the hook declares, or whose
descriptor breaks its contract (:mod:`sexpgpu.lang.contracts`), is kept refused.
Two plugins supplying one thing conflict: the contested thing is refused
(``E-PLUGIN-001``), never given to whichever loaded first (:mod:`sexpgpu.plugin_supplies`).

Environment variables: ``SEXPGPU_DISABLE_PLUGINS=a,b`` skips plugins by
entry-point name; ``SEXPGPU_DISABLE_DISTRIBUTIONS=x,y`` skips every plugin of
those distributions; ``SEXPGPU_TRACE_PLUGINS=1`` logs every hook call and keeps
the traceback of a plugin that failed.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable, Collection, Mapping
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
    traceback_text,
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

    @property
    def state(self) -> str:
        """``available``, ``unavailable`` (it cannot work here) or ``refused``."""
        return "available" if self.available else "refused" if self.refused else "unavailable"


class Catalog:
    """The loaded plugins and what they supply, asked for by hook.

    Build one with :meth:`load` (entry points) or :meth:`of` (modules in hand). Each
    supplying hook is asked once, when first needed, and its answer kept: the
    descriptors are cheap, and asking again would only repeat the same answer.
    """

    def __init__(self) -> None:
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        """Every plugin found, in load order (by entry-point name)."""
        self.warnings: list[str] = []
        """Mistakes in the environment (a disabled name that matches nothing)."""
        self.command_conflicts: list[Conflict] = []
        """Commands two plugins add (found by the CLI as it adds them)."""
        self._supplied: dict[str, list[tuple[Any, PluginRecord]]] = {}
        self._failed: set[tuple[str, str]] = set()  # (plugin, hook) whose hook raised
        self._tracing = os.environ.get(TRACE_PLUGINS, "").strip() not in ("", "0")
        if self._tracing:
            self._trace()

    # -- building

    @classmethod
    def load(cls) -> Catalog:
        """The plugins the entry-point group ``sexpgpu`` names, as the environment
        variables of this module's docstring allow."""
        importlib.invalidate_caches()  # a plugin installed since the last look is found
        catalog = cls()
        catalog._load_entry_points()
        return catalog

    @classmethod
    def of(cls, plugins: Mapping[str, Any], *, distribution: str = PROJECT_DISTRIBUTION) -> Catalog:
        """A catalog of ``plugins`` (name -> a module or object with ``@hookimpl``
        functions), registered as entry points would be, and nothing else."""
        catalog = cls()
        for name in sorted(plugins):
            plugin = plugins[name]
            record = PluginRecord(
                name=name,
                module=getattr(plugin, "__name__", type(plugin).__name__),
                distribution=distribution,
                version=__version__ if distribution == PROJECT_DISTRIBUTION else "?",
            )
            catalog.records.append(record)
            catalog._register(record, lambda plugin=plugin: plugin)
        return catalog

    def _load_entry_points(self) -> None:
        names = _listed(DISABLE_PLUGINS)
        distributions = {_normalized(d) for d in _listed(DISABLE_DISTRIBUTIONS)}

        def order(entry_point: metadata.EntryPoint) -> tuple[str, bool]:
            # by name; for a name two distributions register, one not disabled first
            return entry_point.name, _normalized(_distribution(entry_point)) in distributions

        for entry_point in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=order):
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
            if record.name in names or _normalized(record.distribution) in distributions:
                by = DISABLE_PLUGINS if record.name in names else DISABLE_DISTRIBUTIONS
                record.available, record.disabled = False, True
                record.reason = f"disabled by {by}"
                continue
            self._register(record, entry_point.load)
        # Only the plugin names warn: a distribution list is usually set by tooling
        # (the test suite) for processes whose sys.path may not hold them all.
        self._warn_unmatched(DISABLE_PLUGINS, names, [r.name for r in self.records])

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
            record.traceback = traceback_text(exc)

    def _warn_unmatched(self, variable: str, names: Collection[str], known: list[str]) -> None:
        for name in names:
            if name in known:
                continue
            hint = f" (did you mean '{close}'?)" if (close := nearest(name, known)) else ""
            self.warnings.append(f"{variable} names '{name}', which is no installed plugin{hint}")

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
        """Call ``hook`` on one plugin only, through pluggy's relay (so argument
        matching and SEXPGPU_TRACE_PLUGINS apply); its non-None result in a list. An
        answer that breaks the hook's contract refuses the plugin, and only what of it
        fits is handed back (:func:`sexpgpu.lang.contracts.held_to_contract`)."""
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
        """Every descriptor loaded plugins supply through ``hook``, with its plugin.
        Unavailable plugins are asked too, so a lookup can say "this needs plugin X,
        which is unavailable because ...". A plugin whose hook raises becomes
        unavailable; one whose descriptor breaks its contract is refused (:meth:`ask`)."""
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
        """The descriptors available plugins supply through ``hook``. One two plugins
        claim (:meth:`conflicts`) comes as a copy whose factories raise ``E-PLUGIN-001``:
        choosing among them works, using the contested one fails with the conflict."""
        claims = self._claims(hook)
        found = find_conflicts(hook, ((i, r.name, r.where) for i, r in claims))
        handed: list[Any] = []
        for item, _ in claims:
            contested = contested_keys(hook, item, found)
            handed.append(refusing(item, contested[0]) if contested else item)
        return handed

    def require(self, hook: str, what: str, matches: Callable[[Any], bool]) -> Any:
        """The available descriptor from ``hook`` for which ``matches`` is true; else a
        :class:`PluginError`: ``E-PLUGIN-001`` naming every plugin when several match,
        the plugin's reason when only an unavailable one does, ``what`` when none does."""
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
        "metrics sink"). An unknown name is refused with the nearest known one, every
        known one, and the plugins disabled that might supply it; else as :meth:`require`."""
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
        """Whether ``record``'s ``hook`` raised when it was asked (the plugin is then
        unavailable, its reason saying why)."""
        return (record.name, hook) in self._failed

    # -- what the core takes, typed

    def lowerings(self) -> list[ext.LoweringInfo]:
        """Every available lowering."""
        return self.available("sexpgpu_lowerings")

    def kernels(self) -> list[ext.KernelInfo]:
        """Every available kernel."""
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
        """The new ops available plugins supply (not a lowering's implementation of a
        built-in op)."""
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
        """The opener of the file ``name`` (by the end of its name; one two plugins claim
        refuses with ``E-PLUGIN-001`` when built); ``None`` when none takes it (a `.sx` file)."""
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


def _distribution(entry_point: metadata.EntryPoint) -> str:
    """The name of the distribution that registers ``entry_point`` (``?`` if unknown)."""
    dist = getattr(entry_point, "dist", None)
    return dist.metadata["Name"] if dist is not None else "?"


def _normalized(distribution: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()

"""How ``sexpgpu plugins`` describes what each plugin supplies: per hook, the word for
one descriptor, the title of its line and its JSON object (always with ``doc``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sexpgpu.catalog import Catalog, PluginRecord
from sexpgpu.lang.ops import REQUIRED
from sexpgpu.plugin_supplies import COMMANDS_HOOK, defaults_of


@dataclass(frozen=True)
class Described:
    """How one hook's descriptors read: ``singular`` names one (``kernel``),
    ``title(info)`` heads its line, ``fields(info)`` are its JSON object's fields."""

    singular: str
    title: Callable[[Any], str]
    fields: Callable[[Any], dict[str, Any]]


def _doc(info: Any) -> str:
    return str(info.doc or "")


def _named(info: Any) -> dict[str, Any]:
    return {"name": info.name, "doc": _doc(info)}


def _with_options(info: Any, option_docs: Mapping[str, str] | None = None) -> dict[str, Any]:
    described = {"name": info.name, "options": dict(info.options), "doc": _doc(info)}
    if option_docs:  # a data source's (an optimizer's options have no docs)
        described["option_docs"] = dict(option_docs)
    return described


def _kernel(info: Any) -> dict[str, Any]:
    return {
        "kind": info.kind,
        "name": info.name,
        "lowering": info.lowering,
        "devices": list(info.devices),
        "deterministic": bool(info.deterministic),
        "priority": info.priority,
        "doc": _doc(info),
    }


def _lowering(info: Any) -> dict[str, Any]:
    return {
        "name": info.name,
        "devices": list(info.devices),
        "default_for": list(defaults_of(info)),
        "doc": _doc(info),
    }


def _op(info: Any) -> dict[str, Any]:
    implementations = info.implementations or {}
    spec = info.spec
    described: dict[str, Any] = {
        "name": info.name,
        "written": list(_written(info)),
        "lowerings": sorted(implementations),
        "doc": _doc(info),
    }
    keywords = getattr(spec, "keywords", ()) or ()
    written = {k.name.replace("_", "-"): k for k in keywords}  # as a .sx file writes them
    required = [name for name, k in written.items() if k.default is REQUIRED]
    if required:
        described["required"] = required
    if len(required) < len(written):
        described["options"] = {n: k.default for n, k in written.items() if n not in required}
    return described


def _written(info: Any) -> tuple[str, ...]:
    """The names a `.sx` file calls an op by (``leaky-relu`` for the op ``leaky_relu``)."""
    return tuple(getattr(info.spec, "surfaces", ()) or (info.name.replace("_", "-"),))


def _name(info: Any) -> str:
    return info.name


def _run_option(info: Any) -> dict[str, Any]:
    described: dict[str, Any] = {"flag": info.flag, "choice": info.choice}
    if info.values:
        described["values"] = list(info.values)
    if info.minimum is not None:
        described["minimum"] = info.minimum
    return {**described, "doc": str(info.help or "")}


DESCRIBED: dict[str, Described] = {
    "sexpgpu_lowerings": Described("lowering", _name, _lowering),
    "sexpgpu_kernels": Described("kernel", lambda i: f"{i.kind}:{i.name}", _kernel),
    "sexpgpu_ops": Described("op", lambda i: " ".join(_written(i)), _op),
    "sexpgpu_optimizers": Described("optimizer", _name, _with_options),
    "sexpgpu_storage_backends": Described(
        "storage",
        lambda i: ", ".join(f"{scheme}://" for scheme in i.schemes),
        lambda i: {"schemes": list(i.schemes), "doc": _doc(i)},
    ),
    "sexpgpu_metrics_sinks": Described("metrics sink", _name, _named),
    "sexpgpu_data_sources": Described(
        "data source", _name, lambda i: _with_options(i, i.option_docs)
    ),
    "sexpgpu_evaluators": Described("evaluator", _name, _named),
    "sexpgpu_eval_metrics": Described("eval metric", _name, _named),
    "sexpgpu_source_openers": Described(
        "source opener",
        lambda i: f"*{i.suffix} ({i.name})",
        lambda i: {"name": i.name, "suffix": i.suffix, "doc": _doc(i)},
    ),
    "sexpgpu_run_options": Described("run option", lambda i: i.flag, _run_option),
}
"""Every hook that supplies descriptors (the keys of :data:`sexpgpu.plugin_supplies.
SUPPLIES`), as ``sexpgpu plugins`` describes them."""


def describe(hook: str, info: Any) -> dict[str, Any] | None:
    """The JSON description of one descriptor, or ``None`` when it cannot be described."""
    kind = DESCRIBED.get(hook)
    if kind is None:
        return None
    try:
        return {"title": kind.title(info), **kind.fields(info)}
    except Exception:  # a malformed descriptor: listed as such, never a traceback
        return {"title": repr(info)[:80], "doc": "(a malformed descriptor)"}


def supplies(catalog: Catalog, record: PluginRecord) -> dict[str, list[dict[str, Any]]]:
    """What ``record`` supplies, by hook (without the ``sexpgpu_`` prefix), described; a
    hook of the plugin's that raised is left out (its reason says why)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for hook in DESCRIBED:
        if record.plugin is None or hook not in record.hooks:
            continue
        items = [item for item, owner in catalog.supplied(hook) if owner is record]
        if catalog.failed(record, hook):
            continue
        described = [d for d in (describe(hook, item) for item in items) if d is not None]
        found[hook.removeprefix("sexpgpu_")] = described
    if record.commands:
        found[COMMANDS_HOOK.removeprefix("sexpgpu_")] = [
            {"title": name, "name": name, "doc": doc} for name, doc in record.commands.items()
        ]
    return found

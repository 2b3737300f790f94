"""Finding a plugin op's implementation for a lowering (the lowering's side of
``sexpgpu_ops``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sexpgpu.errors import PluginError, Pos

NO_IMPLEMENTATION = "E-OP-001"


def implementation_of(
    op: str, plugin: str | None, lowering: str, ops: Sequence[Any], pos: Pos | None = None
) -> Callable[[], Any]:
    """The factory of ``lowering``'s implementation of op ``op`` among ``ops`` (the
    :class:`sexpgpu.extension.OpInfo` of new ops, ``Supplies.ops``).

    A lowering calls this for a node whose op it does not know (a plugin op
    records its plugin in ``node.attrs["plugin"]``). Raises
    :class:`sexpgpu.errors.PluginError` ``E-OP-001`` naming the op, the plugin
    and the lowering when no implementation for it is supplied.
    """
    offered = [info for info in ops if _named(info, op)]
    for info in offered:
        factory = dict(info.implementations).get(lowering)
        if factory is not None:
            return factory
    others = sorted({name for info in offered for name in info.implementations})
    source = f" from the plugin '{plugin}'" if plugin else ""
    raise PluginError(
        f"the op '{op}'{source} has no implementation for the lowering '{lowering}'"
        f" (it has: {', '.join(others) or 'none'}); use a lowering it names, or a version"
        " of the plugin that implements it for this one",
        code=NO_IMPLEMENTATION,
        pos=pos,
    )


def _named(info: Any, op: str) -> bool:
    return info.name == op or info.spec.name == op

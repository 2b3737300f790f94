"""The contracts of a plugin's op and optimizer, held on the program's real shapes when
it is lowered, so a plugin that breaks one is named with the user's call site before
step 1, instead of failing somewhere downstream in it.

Each check first runs the plugin's code on ``meta`` tensors (shapes and dtypes, no
data, no memory). An op with no meta implementation is tried once on zeros on the
run's device; an optimizer whose ``init_states`` needs real tensors is held to its
contract when it makes its first states (:func:`check_states`, which the trainer
calls there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sexpgpu.errors import PluginError, Pos
from sexpgpu.lang.ir import Node, TensorType
from sexpgpu_torch.dtypes import TORCH_DTYPES


def _stand_ins(types: Sequence[TensorType], device: torch.device | str) -> list[torch.Tensor]:
    return [torch.zeros(tuple(t.shape), dtype=TORCH_DTYPES[t.dtype], device=device) for t in types]


def _shown(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    dtype = next((k for k, v in TORCH_DTYPES.items() if v == value.dtype), str(value.dtype))
    return f"{dtype}[{', '.join(map(str, value.shape))}]"


def check_op(
    fn: Callable[..., Any], node: Node, args: Sequence[TensorType], device: torch.device
) -> None:
    """Refuse ``fn``, a plugin op's torch function for ``node``, when on arguments of
    ``args``' types it gives another type than the spec declared for the node."""
    got: Any = None
    for where in ("meta", device):
        try:
            with torch.no_grad():
                got = fn(*_stand_ins(args, where))
            break
        except Exception:  # noqa: S112 - no meta kernel, or zeros it refuses: try the next
            continue
    else:
        return  # it runs on nothing it can be given here; a failure at run time says so
    if isinstance(got, torch.Tensor) and _shown(got) == str(node.type):
        return
    plugin = node.attrs.get("plugin")
    given = ", ".join(map(str, args))
    raise PluginError(
        f"the op '{node.op}' of the plugin '{plugin}' gives {_shown(got)} for ({given}), "
        f"where its spec declares {node.type}; the plugin's implementation and its infer disagree",
        pos=node.pos,
    )


def check_states(
    info: Any,
    states: Any,
    params: Sequence[torch.Tensor],
    options: Mapping[str, Any],
    pos: Pos | None,
    made_by: str = "init_states",
) -> None:
    """Refuse ``states``, made by optimizer ``info``'s update (``made_by``), unless it
    holds exactly the names ``info.state_names(options)`` declares, each a list of one
    tensor per parameter in ``params`` and of its shape."""
    declared = tuple(info.state_names(options))
    who = f"the optimizer '{info.name}' of the plugin '{info.plugin}'"
    if not isinstance(states, Mapping) or set(states) != set(declared):
        made = sorted(states) if isinstance(states, Mapping) else type(states).__name__
        raise PluginError(
            f"{who}: its {made_by} made the states {made}, where its state_names declares "
            f"{sorted(declared)}",
            pos=pos,
        )
    for name in declared:
        tensors = list(states[name])
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in tensors]
        if shapes != [tuple(p.shape) for p in params]:
            raise PluginError(
                f"{who}: its {made_by} made the state '{name}' of {len(tensors)} tensors whose "
                f"shapes are not those of the {len(params)} trainable parameters",
                pos=pos,
            )


def check_optimizer(
    info: Any, update: Any, options: Mapping[str, Any], types: Sequence[TensorType], pos: Pos
) -> None:
    """Hold optimizer ``info``'s ``init_states`` to its ``state_names`` on meta stand-ins
    of the trainable parameters (``types``), before any step."""
    params = [
        torch.empty(tuple(t.shape), dtype=TORCH_DTYPES[t.dtype], device="meta") for t in types
    ]
    try:
        states = update.init_states(params, options)
    except Exception:
        return  # it needs real tensors: held to the contract when its states are made
    check_states(info, states, params, options, pos)

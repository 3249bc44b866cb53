"""Custom ops that communicate inside their own body, and how they find their process group.

Some of autopar's custom ops issue collectives themselves (the experts' all-to-alls,
``autopar.capture.moe``; ring attention's sends, ``autopar.passes.ring_attention``). A graph node
of such an op hides its collectives from a walk of the graph, so each registers its Python body
here with :func:`register_op_with_collectives`: the dispatch mode that counts collectives
(``autopar.runtime.profile.CommMeter``) runs that body under itself to see them, as it sees the
collectives of the rest of the program.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

__all__ = ["OPS_WITH_COLLECTIVES", "group_rank_size", "register_op_with_collectives"]

OPS_WITH_COLLECTIVES: dict[Any, Callable[..., Any]] = {}


def register_op_with_collectives(op: Any, body: Callable[..., Any]) -> None:
    """Record ``body`` as the Python body of the custom op overload ``op``, which issues
    collectives inside. Registering another body for the same op is refused."""
    if op in OPS_WITH_COLLECTIVES and OPS_WITH_COLLECTIVES[op] is not body:
        raise ValueError(f"{op} already has a body with collectives registered "
                         f"({OPS_WITH_COLLECTIVES[op]}); register each op once.")
    OPS_WITH_COLLECTIVES[op] = body


def group_rank_size(name: str) -> tuple[Any, int, int]:
    """(process group or None, this rank in it, its size) of a group name (``""`` for none):
    how the ops that communicate inside find their group."""
    if not name:
        return None, 0, 1
    from autopar._torch_private import resolve_process_group

    pg = resolve_process_group(name)
    return pg, dist.get_rank(pg), dist.get_world_size(pg)

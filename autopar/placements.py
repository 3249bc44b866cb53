"""Text form of DTensor placements for plans and tables: ``R``, ``S(0)``, ``P(sum)``, ``SS(0,3)``.

``SS(dim,k)`` is a strided shard: the dim is k equal parts, each sharded (fused projections).
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._torch_private import _StridedShard

__all__ = ["to_str", "from_str", "fmt", "is_kind"]

_SHARD = re.compile(r"^S\((\d+)\)$")
_PARTIAL = re.compile(r"^P\((\w+)\)$")
_STRIDED = re.compile(r"^SS\((\d+),(\d+)\)$")


def is_kind(p: object, cls: type | tuple[type, ...]) -> bool:
    """``isinstance(p, cls)`` for a placement, answered once per type: on torch 2.13 the
    placement classes check instances through a Python metaclass (about 1 us a call), and the
    strategy space asks millions of times (DeepSeek-V3's first pipeline stage: 2.9 million)."""
    return _is_kind(type(p), cls)


@functools.lru_cache(maxsize=None)
def _is_kind(kind: type, cls: type | tuple[type, ...]) -> bool:
    return issubclass(kind, cls)


def to_str(p: Placement) -> str:
    """``Replicate()`` -> ``R``; ``Shard(1)`` -> ``S(1)``; ``Partial("sum")`` -> ``P(sum)``."""
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard) and type(p) is Shard:
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    if isinstance(p, _StridedShard):
        return f"SS({p.dim},{p.split_factor})"
    raise ValueError(f"placement {p!r} has no text form in plans")


def from_str(text: str) -> Placement:
    """Inverse of :func:`to_str`."""
    if text == "R":
        return Replicate()
    m = _SHARD.match(text)
    if m:
        return Shard(int(m.group(1)))
    m = _STRIDED.match(text)
    if m:
        return _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
    m = _PARTIAL.match(text)
    if m:
        return Partial(m.group(1))
    raise ValueError(f"cannot read placement {text!r}: expected R, S(dim) or P(op)")


def fmt(placements: Sequence[Placement] | None) -> str:
    """A placement tuple as ``[S(0), R]``."""
    if placements is None:
        return "-"
    return "[" + ", ".join(to_str(p) for p in placements) + "]"

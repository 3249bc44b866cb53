"""Text form of DTensor placements for plans and tables: ``R``, ``S(0)``, ``P(sum)``."""

from __future__ import annotations

import re
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["to_str", "from_str", "fmt"]

_SHARD = re.compile(r"^S\((\d+)\)$")
_PARTIAL = re.compile(r"^P\((\w+)\)$")


def to_str(p: Placement) -> str:
    """``Replicate()`` -> ``R``; ``Shard(1)`` -> ``S(1)``; ``Partial("sum")`` -> ``P(sum)``."""
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard) and type(p) is Shard:
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise ValueError(f"placement {p!r} has no text form in plans")


def from_str(text: str) -> Placement:
    """Inverse of :func:`to_str`."""
    if text == "R":
        return Replicate()
    m = _SHARD.match(text)
    if m:
        return Shard(int(m.group(1)))
    m = _PARTIAL.match(text)
    if m:
        return Partial(m.group(1))
    raise ValueError(f"cannot read placement {text!r}: expected R, S(dim) or P(op)")


def fmt(placements: Sequence[Placement] | None) -> str:
    """A placement tuple as ``[S(0), R]``."""
    if placements is None:
        return "-"
    return "[" + ", ".join(to_str(p) for p in placements) + "]"

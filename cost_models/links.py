"""Links between devices: one link class of a mesh axis in the alpha-beta model.

Owns :class:`AxisLink` (a bus bandwidth, a per-step latency and a per-call launch time, with the
bandwidths of the collective kinds that differ and the measured bandwidths by message size),
:data:`COLLECTIVE_KINDS` (the collectives the cost model prices) and the value and key checks that
:class:`~autopar.cost_models.topology.Topology` shares with it. A topology holds two such links,
``intra_node`` and ``inter_node`` (:mod:`autopar.cost_models.topology`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["COLLECTIVE_KINDS", "AxisLink", "check_keys", "check_positive"]

# The collectives the cost model prices (autopar.cost_models.comm), one bandwidth each at most.
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
)


def check_positive(owner: str, name: str, value: float, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or math.isinf(value):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be finite and {bound}, got {value!r}")


@dataclass(frozen=True)
class AxisLink:
    """One link class of a mesh axis, in the alpha-beta model.

    Attributes:
        bandwidth_Bps: bus bandwidth per device in bytes/s (nccl-tests "busbw"), already effective.
        latency_s: per ring step latency (alpha), seconds.
        launch_s: fixed per-collective overhead (kernel launch, protocol setup), seconds.
        bandwidth_by_kind: bus bandwidths of the collective kinds (:data:`COLLECTIVE_KINDS`)
            that differ from ``bandwidth_Bps`` (gloo's reduce-scatter on a CPU, NCCL's NVLS
            all-reduce), as ``{kind: bytes/s}`` or pairs; empty: one bandwidth for all.
        busbw_by_size: measured bus bandwidths by message size, ``(kind, ranks, ((bytes,
            bytes/s), ...))`` entries (:mod:`autopar.cost_models.nccl_curves`): collective
            ``kind`` over ``ranks`` ranks is priced by them (:meth:`busbw_at`), not by the
            alpha-beta line; other rank counts keep the line.
    """

    bandwidth_Bps: float
    latency_s: float
    launch_s: float
    bandwidth_by_kind: tuple[tuple[str, float], ...] = ()
    busbw_by_size: tuple[tuple[str, int, tuple[tuple[float, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        check_positive("AxisLink", "bandwidth_Bps", self.bandwidth_Bps)
        check_positive("AxisLink", "latency_s", self.latency_s, allow_zero=True)
        check_positive("AxisLink", "launch_s", self.launch_s, allow_zero=True)
        pairs = dict(self.bandwidth_by_kind)
        for kind, value in pairs.items():
            if kind not in COLLECTIVE_KINDS:
                raise ValueError(f"AxisLink.bandwidth_by_kind: unknown collective kind {kind!r}; "
                                 f"valid kinds: {', '.join(COLLECTIVE_KINDS)}")
            check_positive("AxisLink", f"bandwidth_by_kind[{kind!r}]", value)
        object.__setattr__(self, "bandwidth_by_kind",
                           tuple(sorted((k, float(v)) for k, v in pairs.items())))
        object.__setattr__(self, "busbw_by_size",
                           tuple(sorted(_checked_curve(e) for e in self.busbw_by_size)))

    def bandwidth_for(self, kind: str) -> float:
        """The bus bandwidth of collective ``kind``: its own, or ``bandwidth_Bps``."""
        for k, value in self.bandwidth_by_kind:
            if k == kind:
                return value
        return self.bandwidth_Bps

    def busbw_at(self, kind: str, nbytes: float, ranks: int) -> float | None:
        """The measured bus bandwidth of ``kind`` over ``ranks`` ranks at ``nbytes`` (``None``
        when not measured): interpolated linearly in log2 of the size between measured sizes;
        below the smallest, its time held (the latency floor: the bandwidth falls with the
        size); above the largest, its bandwidth."""
        for k, n, pts in self.busbw_by_size:
            if k != kind or n != ranks:
                continue
            if nbytes <= pts[0][0]:
                return pts[0][1] * nbytes / pts[0][0]
            for (b0, v0), (b1, v1) in zip(pts, pts[1:]):
                if nbytes <= b1:
                    w = math.log2(nbytes / b0) / math.log2(b1 / b0)
                    return v0 + (v1 - v0) * w
            return pts[-1][1]
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form of this link (``bandwidth_by_kind`` and ``busbw_by_size`` only when
        they have entries)."""
        out: dict[str, Any] = {
            "bandwidth_Bps": float(self.bandwidth_Bps),
            "latency_s": float(self.latency_s),
            "launch_s": float(self.launch_s),
        }
        if self.bandwidth_by_kind:
            out["bandwidth_by_kind"] = dict(self.bandwidth_by_kind)
        if self.busbw_by_size:
            out["busbw_by_size"] = [[k, n, [list(p) for p in pts]] for k, n, pts in self.busbw_by_size]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AxisLink":
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on missing or unknown keys."""
        if not isinstance(data, Mapping):
            raise ValueError(f"AxisLink.from_dict expects a mapping, got {type(data).__name__}")
        check_keys("AxisLink", {"bandwidth_by_kind": {}, "busbw_by_size": [], **data},
                    {f.name for f in dataclasses.fields(cls)})
        return cls(
            bandwidth_Bps=float(data["bandwidth_Bps"]),
            latency_s=float(data["latency_s"]),
            launch_s=float(data["launch_s"]),
            bandwidth_by_kind=tuple(dict(data.get("bandwidth_by_kind", {})).items()),
            busbw_by_size=tuple(tuple(e) for e in data.get("busbw_by_size", [])),
        )


def _checked_curve(entry: Any) -> tuple[str, int, tuple[tuple[float, float], ...]]:
    """One ``AxisLink.busbw_by_size`` entry, checked and with its points sorted by size."""
    try:
        kind, ranks, points = entry
        pts = tuple(sorted((float(b), float(v)) for b, v in points))
    except (TypeError, ValueError) as e:
        raise ValueError(f"AxisLink.busbw_by_size entry {entry!r}: (kind, ranks, ((bytes, "
                         f"bytes/s), ...)) is required ({e})") from e
    if kind not in COLLECTIVE_KINDS or not isinstance(ranks, int) or ranks < 2 or len(pts) < 2 \
            or any(b <= 0 or v <= 0 for b, v in pts):
        raise ValueError(f"AxisLink.busbw_by_size entry {entry!r}: the kind must be one of "
                         f"{list(COLLECTIVE_KINDS)}, ranks an int >= 2, and two or more points "
                         f"(bytes > 0, bytes/s > 0) given")
    return kind, ranks, pts


def check_keys(owner: str, data: Mapping[str, Any], expected: set[str]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner}.from_dict expects a mapping, got {type(data).__name__}")
    missing = sorted(expected - set(data))
    unknown = sorted(set(data) - expected)
    if missing or unknown:
        raise ValueError(
            f"{owner}.from_dict: missing keys {missing}, unknown keys {unknown}; "
            f"expected exactly {sorted(expected)}"
        )

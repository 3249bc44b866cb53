"""What the collectives' byte counts of a plan and of a run must agree on exactly, rank by rank."""

from __future__ import annotations

__all__ = ["routing_independent"]


def routing_independent(bytes_by_kind: dict[str, float]) -> dict[str, float]:
    """The bytes per collective kind without the all-to-alls of MoE layers, which move what the
    routing sends (compared summed over the ranks, where the plan's expectation holds)."""
    return {k: v for k, v in bytes_by_kind.items() if k != "all_to_all"}

"""Candidate logical meshes of one pipeline stage and the technique settings to try."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from autopar.config import Config
from autopar.errors import PlanError

__all__ = ['Candidate', 'memory_techniques', 'mesh_candidates']


@dataclass(frozen=True)
class Candidate:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    dp_axes: tuple[int, ...]


def mesh_candidates(world: int, config: Config) -> list[Candidate]:
    """Logical meshes to try: (dp, tp) factorisations of ``world`` allowed by the config
    (``world`` is the devices of one pipeline stage)."""
    out = []
    for tp in range(1, world + 1):
        if world % tp:
            continue
        dp = world // tp
        if (config.tp is not None and config.tp != tp) or (config.dp is not None and config.dp != dp):
            continue
        if dp > 1 and tp > 1:
            out.append(Candidate((dp, tp), ("dp", "tp"), (0,)))
        elif tp > 1 or world == 1:
            out.append(Candidate((tp,), ("tp",), ()))
        else:
            out.append(Candidate((dp,), ("dp",), (0,)))
    if not out:
        raise PlanError(
            f"no (dp, tp) with dp * tp = {world} devices matches Config(dp={config.dp}, "
            f"tp={config.tp}); choose degrees whose product is the mesh size, or leave them None.")
    return out


def memory_techniques(config: Config) -> list[Config]:
    """The concrete (recompute, zero) settings ``config`` allows, cheapest first: ZeRO-1 costs
    no extra communication (a reduce-scatter and an all-gather move what one all-reduce does,
    Rajbhandari et al., SC'20, sec. 7.2.1), recomputation costs forward compute, ZeRO-3 half
    as much communication again (sec. 7.2.2), so it comes last."""
    recompute = [config.recompute] if config.recompute is not None else ["none", "selective", "full"]
    if config.zero is not None:
        return [dataclasses.replace(config, recompute=r, zero=config.zero) for r in recompute]
    groups = ((0, 1),) if config.pp is not None and config.pp > 1 else ((0, 1), (3,))  # (no
    # ZeRO-3 pipeline yet)
    return [dataclasses.replace(config, recompute=r, zero=z) for group in groups
            for r in recompute for z in group]

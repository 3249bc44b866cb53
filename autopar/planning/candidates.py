"""Candidate logical meshes of one pipeline stage and the technique settings to try."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from autopar.config import Config
from autopar.errors import PlanError

__all__ = ['Candidate', 'HSDP_AXES', 'cp_orders', 'ep_degrees', 'ep_in_cp', 'ep_options', 'inner_axes',
           'memory_techniques', 'mesh_candidates']


@dataclass(frozen=True)
class Candidate:
    """A logical mesh of one pipeline stage: its axes' sizes and names, the axes the batch is
    split over (``dp_axes``), if not all of those, the ones ZeRO shards parameters over
    (``shard_axes``: hybrid sharding's inner data axis), the context-parallel axis the
    sequence is split over (``cp_axes``) and the data axis the experts of MoE layers are split
    over (``ep_axes``)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    dp_axes: tuple[int, ...]
    shard_axes: tuple[int, ...] | None = None
    cp_axes: tuple[int, ...] = ()
    ep_axes: tuple[int, ...] = ()

    @property
    def zero_axes(self) -> tuple[int, ...]:
        """The axes ZeRO shards the parameters over."""
        return self.dp_axes if self.shard_axes is None else self.shard_axes


# hybrid sharding's data axes: across the shard groups, and within one (FSDP2's HSDP mesh)
HSDP_AXES = ("dp_replicate", "dp_shard")


def mesh_candidates(world: int, config: Config, experts: int = 0,
                    gpus_per_node: int | None = None) -> list[Candidate]:
    """Logical meshes to try: (dp, cp, tp) factorisations of ``world`` allowed by the config
    (``world`` is the devices of one pipeline stage; cp is ``Config.cp``, 1 when ``None``);
    with ``Config.dp_shard`` smaller than dp, the dp axis is cut into (``dp_replicate``,
    ``dp_shard``), the shard groups being consecutive ranks (inside a node first); with an
    expert-parallel degree ep > 1 (:func:`ep_degrees`; ``experts``: the experts of the model's
    MoE layers, 0 without), into (``dp``, ``ep``), the ep groups consecutive ranks, an axis of size
    1 left out. Axes run data, context, tensor (outermost first), as Megatron-LM orders
    them, or data, tensor, context (:func:`cp_orders`)."""
    cp = config.cp or 1
    if world % cp:
        raise PlanError(f"Config(cp={cp}) does not divide the {world} devices of a stage; use a "
                        f"divisor of {world}.")
    out = []
    for tp in range(1, world // cp + 1):
        if (world // cp) % tp:
            continue
        dp = world // cp // tp
        if (config.tp is not None and config.tp != tp) or (config.dp is not None and config.dp != dp):
            continue
        shard = config.dp_shard
        if shard is not None and shard not in (1, dp) and config.zero != 0 and dp > 1:
            if dp % shard:
                continue
            data = ((dp // shard, shard), HSDP_AXES, (0, 1), (1,))
        elif dp > 1 and (tp > 1 or cp > 1):
            data = ((dp,), ("dp",), (0,), None)
        elif dp > 1 or (world == 1):
            data = ((dp,), ("dp",) if dp > 1 else ("tp",), (0,) if dp > 1 else (), None)
        else:
            data = ((), (), (), None)
        for inside in cp_orders(config, cp, tp, gpus_per_node):
            inner = inner_axes(cp, tp, inside)
            for shape, names, dp_axes, shard_axes, ep_axes in _expert_splits(data, dp, config,
                                                                              experts):
                cp_axis = len(shape) + [n for n, _ in inner].index("cp") if cp > 1 else None
                out.append(Candidate((*shape, *(d for _, d in inner)),
                                     (*names, *(n for n, _ in inner)), dp_axes, shard_axes,
                                     () if cp_axis is None else (cp_axis,),
                                     (cp_axis,) if ep_axes == "cp" else ep_axes))
    if not out:
        raise PlanError(
            f"no (dp, tp) with dp * tp = {world // cp} devices (with cp={cp}) matches "
            f"Config(dp={config.dp}, tp={config.tp}, ep={config.ep}, ep_in_cp={config.ep_in_cp}); "
            f"choose degrees whose product is the mesh size (ep dividing dp, or ep = cp > 1 with "
            f"ep_in_cp), or leave them None.")
    return out


def inner_axes(cp: int, tp: int, cp_inside_tp: bool) -> list[tuple[str, int]]:
    """The cp and tp axes larger than 1, as ``(name, size)`` outermost first: cp then tp
    (Megatron-LM's order), or tp then cp with ``cp_inside_tp`` (the one owner of that order)."""
    axes = [(n, d) for n, d in (("cp", cp), ("tp", tp)) if d > 1]
    return axes[::-1] if cp_inside_tp else axes


def cp_orders(config: Config, cp: int, tp: int, gpus_per_node: int | None) -> list[bool]:
    """The mesh orders of the cp and tp axes to try (``True``: cp inside tp, its ranks
    consecutive): ``Config.cp_inside_tp`` when set, else tp inside cp (Megatron-LM's order) and,
    where cp x tp spans more than a node of ``gpus_per_node`` devices (so that one of the two
    axes crosses nodes, and which one changes the price), cp inside tp too. With cp or tp of 1
    there is one order."""
    if cp == 1 or tp == 1:
        return [False]
    if config.cp_inside_tp is not None:
        return [config.cp_inside_tp]
    return [False, True] if gpus_per_node is not None and cp * tp > gpus_per_node else [False]


def ep_degrees(config: Config, dp: int, experts: int) -> list[int]:
    """The expert-parallel degrees cut from dp to try for ``dp`` replicas and MoE layers of
    ``experts`` experts (0: none; several layers: the gcd of their counts): ``Config.ep`` when
    set (if it divides dp), else 1 and every divisor of dp that splits the experts evenly; only
    1 when ``Config.ep_in_cp`` takes the ep ranks from cp (:func:`ep_in_cp`)."""
    if config.ep_in_cp:
        return [1]
    if config.ep is not None:
        return [config.ep] if dp % config.ep == 0 and (config.ep == 1 or experts) else []
    return [1] + [e for e in range(2, dp + 1) if dp % e == 0 and experts and experts % e == 0]


def ep_in_cp(config: Config, cp: int, experts: int) -> bool:
    """Whether to try the experts split over the cp axis (ep = ``cp``, the ep ranks taken from
    cp: Megatron-LM's MoE parallel folding): ``Config.ep_in_cp`` is not ``False``,
    ``Config.ep`` is ``None`` or ``cp``, and the ``experts`` split evenly over cp > 1."""
    return (config.ep_in_cp is not False and cp > 1 and config.ep in (None, cp)
            and experts > 0 and experts % cp == 0)


def ep_options(config: Config, dp: int, cp: int, experts: int, hybrid: bool = False
               ) -> list[tuple[int, bool]]:
    """The expert-parallel choices to try as ``(ep, from cp)``: ep = 1 unless ``Config.ep``
    asks for more, each degree > 1 cut from dp (:func:`ep_degrees`), and the cp ranks
    (:func:`ep_in_cp`); beside hybrid sharding's axes (``hybrid``), or with ``Config.dp_shard``
    set (which ``Config`` refuses beside an ep > 1: a pipeline stage with ep shards its dense
    weights over the ep ranks only, ``sharding.zero_once_placement``), ep = 1 only (the one
    owner of these rules: the per-operator candidates and the setup search both ask it)."""
    if hybrid or config.dp_shard is not None:
        return [(1, False)] if config.ep in (None, 1) else []
    out = [(e, False) for e in ep_degrees(config, dp, experts) if e > 1 or config.ep in (None, 1)]
    if ep_in_cp(config, cp, experts):
        out.append((cp, True))
    return out


def _expert_splits(data: tuple, dp: int, config: Config, experts: int) -> list[tuple]:
    """The data axes ``data`` (shape, names, dp axes, shard axes) for each choice of
    :func:`ep_options`, with their ep axes: as they are (ep = 1), with dp cut into (``dp``,
    ``ep``), or as they are with the ep axis ``"cp"`` (the ep ranks taken from cp)."""
    out = []
    for ep, from_cp in ep_options(config, dp, config.cp or 1, experts, data[1] == HSDP_AXES):
        if from_cp:
            out.append((*data, "cp"))
        elif ep == 1:
            out.append((*data, ()))
        elif ep == dp:
            out.append(((ep,), ("ep",), (0,), None, (0,)))
        else:
            out.append(((dp // ep, ep), ("dp", "ep"), (0, 1), None, (1,)))
    return out


def memory_techniques(config: Config) -> list[Config]:
    """The concrete (recompute, zero) settings ``config`` allows, cheapest first: ZeRO-1 costs
    no extra communication (a reduce-scatter and an all-gather move what one all-reduce does,
    Rajbhandari et al., SC'20, sec. 7.2.1), recomputation costs forward compute, ZeRO-3 half
    as much communication again (sec. 7.2.2), so it comes last."""
    recompute = [config.recompute] if config.recompute is not None else ["none", "selective", "full"]
    if config.zero is not None:
        return [dataclasses.replace(config, recompute=r, zero=config.zero) for r in recompute]
    return [dataclasses.replace(config, recompute=r, zero=z) for group in ((0, 1), (3,))
            for r in recompute for z in group]

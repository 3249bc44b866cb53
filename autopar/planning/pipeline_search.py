"""The per-unit path's pipeline search: pp degree, stage mesh, microbatches, schedule, virtual
stages and cuts.

For every pipeline degree ``pp > 1`` dividing the devices, every (dp, tp) mesh of one stage and
every microbatch count, the model is traced at the microbatch's shape and solved whole by the
intra-operator ILP on the stage mesh; its per-node times and memory, summed per layer unit
(``pre``, each block, ``post``), are the :class:`LayerCost` chain the stage-cut solver cuts. For
every schedule and virtual-stage count the cut solver minimises the predicted step time within
the device memory, and the schedule simulator prices the result. The best setup is then planned
for real by :func:`autopar.planning.pipeline.build_pipeline_plan`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from autopar.config import Config
from autopar.cost_models.pipeline import SCHEDULES, check_schedule, in_flight, simulate
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.mesh import Mesh
from autopar.capture.layers import is_backward, layer_units
from autopar.capture.moe import expert_count
from autopar.solver.ilp import InfeasibleMemoryError, format_bytes
from autopar.planning.candidates import Candidate, mesh_candidates
from autopar.planning.pipeline import WEIGHT_FRACTION, PipelineSetup, batch_size, send_times
from autopar.planning.solve import solve_space
from autopar.solver.stage_cuts import LayerCost, solve_cuts
from autopar.capture.stages import ForwardGraph, capture_with_forward, first_microbatch

__all__ = ["chosen_comm", "search_pipeline", "unit_costs"]

_MAX_MICROBATCH_CANDIDATES = 3


def _microbatch_counts(batch: int, pp: int, dp: int, config: Config) -> list[int]:
    if config.microbatch_size is not None:
        b = config.microbatch_size
        if batch % b or b % dp:
            return []
        return [batch // b]
    valid = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % dp == 0]
    preferred = [m for m in valid if pp <= m <= 4 * pp]
    return (preferred or [max(valid)] if valid else [])[:_MAX_MICROBATCH_CANDIDATES]


def _no_microbatch_count(batch: int, dp: int, config: Config) -> str:
    """Why no microbatch count splits ``batch`` over ``dp`` replicas under ``config``."""
    b = config.microbatch_size
    if b is None:
        return f"no microbatch count splits the batch of {batch} evenly over dp={dp} replicas"
    fits = [k * dp for k in range(1, batch // dp + 1) if batch % (k * dp) == 0]
    hint = (f"use microbatch_size={dp} for one sample per replica" if dp in fits
            else f"choose one of {fits}")
    return (f"Config(microbatch_size={b}) counts the samples of a microbatch over all dp={dp} "
            f"replicas: it must divide the batch ({batch}) and be a multiple of dp; {hint}")


def _schedules(pp: int, units: int, config: Config) -> list[tuple[str, int]]:
    names = [config.schedule] if config.schedule else list(SCHEDULES)
    out = []
    for name in names:
        vs = [1] if name in ("gpipe", "1f1b") else [v for v in (1, 2, 4) if pp * v <= units]
        if config.virtual_stages is not None:
            vs = [v for v in vs if v == config.virtual_stages]
        out += [(name, v) for v in vs]
    return out


def unit_costs(traced: TracedGraph, units: tuple[str, ...], prefix: str | None, space: Any,
               costs: Any, choice: dict[str, int], fwd: ForwardGraph, cand: Candidate, pp: int,
               mesh: Mesh) -> list[LayerCost]:
    """Per layer unit: forward and backward seconds, state and activation bytes, send time.

    Node costs are those of the chosen strategies (compute, resharding into the node, delivering
    outputs); a parameter's state counts in every unit that reads it (a tied weight is held by
    two stages).
    """
    nodes = list(traced.gm.graph.nodes)
    _, unit_of = layer_units(nodes, prefix, len(units) - 2)
    params = {p.node for p in traced.params}
    fw, bw = np.zeros(len(units)), np.zeros(len(units))
    state, act = np.zeros(len(units)), np.zeros(len(units))
    backward = {n.name for n in nodes if is_backward(n)}
    for n in nodes:
        if n.name not in choice:
            continue
        if n.name in params:
            users = {unit_of[u.name] for u in n.users if u.name in unit_of and u.name not in backward}
            for u in users or {0}:
                state[u] += costs.memory[n.name][choice[n.name]]
            continue
        u = unit_of.get(n.name, len(units) - 1)
        t = costs.compute[n.name][choice[n.name]]
        (bw if n.name in backward else fw)[u] += t
        act[u] += costs.memory[n.name][choice[n.name]]
    for name, in_backward, t in chosen_comm(space, costs, choice, backward):
        (bw if in_backward else fw)[unit_of.get(name, len(units) - 1)] += t
    send = send_times(fwd, units, cand, pp, mesh)
    return [LayerCost(units[i], float(fw[i]), float(bw[i]), float(state[i]), float(act[i]), send[i])
            for i in range(len(units))]


def chosen_comm(space: Any, costs: Any, choice: dict[str, int], backward: set[str]
                ) -> Iterator[tuple[str, bool, float]]:
    """The collective seconds of the chosen strategies: ``(node, in the backward, seconds)`` for
    every resharding into a node and every delivery of a graph output (a gradient counts as
    backward, the loss and boundary values as forward)."""
    for (name, k), m in costs.edges.items():
        src = space.nodes[name].inputs[k][0]
        yield name, name in backward, float(m[choice[src], choice[name]])
    for value, param, m in costs.outputs.values():
        t = m[choice[value[0]]] if param is None else m[choice[value[0]], choice[param]]
        yield value[0], param is not None, float(t)


def search_pipeline(model: Any, example_inputs: Any, mesh: Mesh, config: Config,
                    cost_passes: Sequence[Callable[..., Any]], budget: float | None,
                    progress: Callable[[str], None] | None = None
                    ) -> tuple[list[PipelineSetup], list[InfeasibleMemoryError], list[str]]:
    """Every feasible pipeline setup, best first; the memory errors and placement failures."""
    batch = batch_size(example_inputs)
    setups: list[PipelineSetup] = []
    infeasible: list[InfeasibleMemoryError] = []
    failures: list[str] = []
    cache: dict[int, tuple[ForwardGraph, TracedGraph]] = {}
    pps = [config.pp] if config.pp not in (None, 1) else [p for p in range(2, mesh.size + 1) if mesh.size % p == 0]
    for pp in pps:
        if mesh.size % pp:
            raise PlanError(f"Config(pp={pp}) does not divide the {mesh.size} devices of the mesh.")
        try:
            cands = mesh_candidates(mesh.size // pp, dataclasses.replace(config, pp=None),
                                    expert_count(model), mesh.topology.gpus_per_node)
        except PlanError as e:  # the fixed dp/tp degrees leave no room for this pp
            failures.append(f"pp={pp}: {e}")
            continue
        for cand in cands:
            dp = math.prod(cand.shape[a] for a in cand.dp_axes)
            counts = _microbatch_counts(batch, pp, dp, config)
            if not counts:
                failures.append(_no_microbatch_count(batch, dp, config))
            for m in counts:
                try:
                    setups += _search_point(model, example_inputs, mesh, config, cost_passes, budget,
                                            pp, cand, m, cache, infeasible)
                except InfeasibleMemoryError as e:
                    infeasible.append(e)
                except PlanError as e:
                    failures.append(f"pp={pp}, stage mesh {cand.shape}, {m} microbatches: {e}")
                if progress and setups:
                    best = min(setups, key=lambda s: s.predicted_s)
                    progress(f"pipeline pp={pp} stage mesh {dict(zip(cand.names, cand.shape))} "
                             f"m={m}: best so far {best.predicted_s * 1e3:.3f} ms")
    setups.sort(key=lambda s: (s.predicted_s, s.memory_bytes))
    return setups, infeasible, failures


def _search_point(model: Any, example_inputs: Any, mesh: Mesh, config: Config,
                  cost_passes: Sequence[Callable[..., Any]], budget: float | None, pp: int,
                  cand: Candidate, m: int, cache: dict, infeasible: list) -> list[PipelineSetup]:
    """The setups of one (pp, stage mesh, microbatch count): a cut per schedule and v."""
    if m not in cache:
        traced, fwd = capture_with_forward(model, first_microbatch(example_inputs, m))
        cache[m] = (fwd, traced)
    fwd, traced = cache[m]
    active = sorted(set(fwd.unit_of.values()))  # units holding computation
    if len(active) < pp:
        raise PlanError(
            f"pipelining cuts a model between its repeated blocks (an nn.ModuleList of layers); "
            f"{type(model).__name__} has {len(active)} layer unit(s) with computation "
            f"({', '.join(fwd.units[i] for i in active)}), fewer than pp={pp} stages. Use pp=1 "
            f"or a model built from repeated blocks.")
    # every stage fits the device only if the whole model fits pp devices (a relaxation: it
    # counts each activation once, the stages hold several microbatches in flight)
    try:
        space, costs, res = solve_space(traced, mesh, config, cand, cost_passes,
                                        budget * pp if budget is not None else None)
    except InfeasibleMemoryError as e:
        raise InfeasibleMemoryError(
            f"pp={pp}, stage mesh {dict(zip(cand.names, cand.shape))}, {m} microbatches: the "
            f"{pp} pipeline ranks together ({pp} x {format_bytes(budget)}) cannot hold the model "
            f"even with one microbatch in flight: it needs {format_bytes(e.required_bytes)}, "
            f"{format_bytes(e.required_bytes - e.budget_bytes)} over, so no stage split fits.",
            # (a per-device need this setup surely meets is not known: the whole model's, as
            # the ILP reported it, keeps the other setups' exact needs first in the error)
            required_bytes=e.required_bytes, budget_bytes=budget) from e
    prefix = fwd.units[1].rsplit(".", 1)[0] if len(fwd.units) > 2 else None
    every = unit_costs(traced, fwd.units, prefix, space, costs, res.choice, fwd, cand, pp, mesh)
    layers = _merge_empty(every, active)
    out: list[PipelineSetup] = []
    refused: list[str] = []
    options = _schedules(pp, len(active), config)
    if not options:
        refused.append(f"Config(schedule={config.schedule!r}, virtual_stages="
                       f"{config.virtual_stages!r}) allows no schedule with {len(active)} layer "
                       f"units on pp={pp} (gpipe and 1f1b take one stage per rank; pp * v must "
                       f"not exceed the layer units)")
    for schedule, v in options:
        try:
            check_schedule(schedule, pp, v, m)
        except ValueError as e:
            refused.append(str(e))
            continue
        flight = in_flight(schedule, pp, v, m)
        try:
            # v > 1 is proved optimal only slowly (96 layers, pp=8: > 30 s); its local-search
            # start is already good, so the search spends at most a few seconds on it
            limit = config.solver_time_limit_s if v == 1 else min(config.solver_time_limit_s, 5.0)
            cut = solve_cuts(layers, pp, m, virtual_stages=v, in_flight=flight,
                             memory_budget_bytes=budget, time_limit_s=limit)
        except InfeasibleMemoryError as e:
            infeasible.append(e)
            continue
        stage_of_unit = _expand(_stage_of_unit(cut.starts, len(layers)), active, len(every))
        fw = [sum(c.forward_s for c, s in zip(every, stage_of_unit) if s == j) for j in range(pp * v)]
        bw = [sum(c.backward_s for c, s in zip(every, stage_of_unit) if s == j) for j in range(pp * v)]
        p2p = max(layers[cut.starts[j] - 1].send_s for j in range(1, pp * v)) / 2
        sim = simulate(schedule, fw, bw, m, pp, p2p_s=p2p,
                       weight_fraction=WEIGHT_FRACTION)
        out.append(PipelineSetup(pp, cand, m, schedule, v, stage_of_unit, sim.step_time_s,
                                 max(cut.rank_memory_bytes)))
    if not out and refused:
        raise PlanError("; ".join(dict.fromkeys(refused)))
    return out


def _merge_empty(every: list[LayerCost], active: list[int]) -> list[LayerCost]:
    """The cut solver's chain: units with computation; an empty unit's costs (parameters that
    are read elsewhere, say) go to the previous active unit."""
    out: list[LayerCost] = []
    for i, c in enumerate(every):
        if i in active or not out:
            out.append(c)
        else:
            last = out[-1]
            out[-1] = LayerCost(last.name, last.forward_s + c.forward_s, last.backward_s + c.backward_s,
                                last.state_bytes + c.state_bytes,
                                last.activation_bytes + c.activation_bytes, c.send_s)
    return out[:len(active)]


def _expand(stages: tuple[int, ...], active: list[int], n: int) -> tuple[int, ...]:
    """Stage of every unit from the stages of the active ones (an empty unit follows the
    previous active unit, or the first one)."""
    out, j = [], 0
    for i in range(n):
        if j < len(active) - 1 and i >= active[j + 1]:
            j += 1
        out.append(stages[j])
    return tuple(out)


def _stage_of_unit(starts: Sequence[int], n: int) -> tuple[int, ...]:
    bounds = list(starts) + [n]
    return tuple(j for j in range(len(starts)) for _ in range(bounds[j], bounds[j + 1]))

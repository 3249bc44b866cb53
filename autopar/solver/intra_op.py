"""Intra-operator ILP: pick one strategy per node of the joint graph (Alpa, OSDI'22 §4.2).

Math (see :mod:`autopar.solver.ilp` for the linearisation):

    min  sum_v c_v . x_v  +  sum_(u,v) x_u^T R_uv x_v
    s.t. sum_s x_v[s] = 1,  x_v in {0,1}^|S_v|
         sum_v m_v . x_v <= M                                   (memory per device)

c_v is the node's compute time per strategy, R_uv the resharding time between the producer's
output placement and the placement the consumer needs, m_v the bytes it keeps alive across the
step (parameter + gradient + optimizer state, or an activation saved for backward), M the device
budget. Nodes of identical layers share one set of variables (their costs add up), tied
parameters share one variable, so the ILP's size does not grow with depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.cost_models.sharding import SpaceCosts
from autopar.graph import TracedGraph
from autopar.solver.ilp import ILPEdge, ILPProblem, ILPSolution, solve_ilp
from autopar.strategies.space import StrategySpace, representatives

__all__ = ["IntraOpResult", "ilp_groups", "solve_intra_op"]


@dataclass(frozen=True)
class IntraOpResult:
    """The chosen strategy index of every node, with solver statistics."""

    choice: dict[str, int]
    solution: ILPSolution
    variables_unlinked: int
    groups: int


def ilp_groups(traced: TracedGraph, space: StrategySpace) -> tuple[dict[str, int], list[str]]:
    """The ILP group of every node (nodes of identical layers and tied parameters share one)
    and each group's representative node."""
    rep = representatives(traced)
    param_node = {p.name: p.node for p in traced.params}
    tied = {p.node: param_node[p.tied_to] for p in traced.params if p.tied_to is not None}
    gid: dict[str, int] = {}
    order: list[str] = []
    group_of: dict[str, int] = {}
    for name in space.nodes:
        r = tied.get(name, name)
        r = rep.get(r, r)
        if r not in gid:
            gid[r] = len(order)
            order.append(r)
        group_of[name] = gid[r]
    return group_of, order


def solve_intra_op(traced: TracedGraph, space: StrategySpace, costs: SpaceCosts,
                   memory_budget: float | None, time_limit_s: float) -> IntraOpResult:
    """Build the linked ILP for ``space`` priced by ``costs`` and solve it."""
    group_of, order = ilp_groups(traced, space)
    size = [len(space.nodes[r].strategies) for r in order]
    node_cost = [np.zeros(s) for s in size]
    node_mem = [np.zeros(s) for s in size]
    edges: dict[tuple[int, int], np.ndarray] = {}
    unlinked = 0
    for name, ns in space.nodes.items():
        g = group_of[name]
        node_cost[g] += costs.compute[name]
        node_mem[g] += costs.memory[name]
        unlinked += len(ns.strategies)
    def add_edge(gu: int, gv: int, m: np.ndarray) -> None:
        nonlocal unlinked
        unlinked += m.size
        if (gu, gv) in edges:
            edges[(gu, gv)] = edges[(gu, gv)] + m
        else:
            edges[(gu, gv)] = m.copy()
    for (name, k), m in costs.edges.items():
        src = space.nodes[name].inputs[k][0]
        if not np.any(m):
            unlinked += m.size
            continue  # free edge: every pair costs nothing
        add_edge(group_of[src], group_of[name], m)
    for value, param, m in costs.outputs.values():
        if param is None:
            node_cost[group_of[value[0]]] += m
        else:
            add_edge(group_of[value[0]], group_of[param], m)
    problem = ILPProblem(
        node_costs=tuple(node_cost), node_memory=tuple(node_mem),
        edges=tuple(ILPEdge(u, v, m) for (u, v), m in edges.items()),
        memory_budget=memory_budget, time_limit_s=time_limit_s, names=tuple(order),
    )
    sol = solve_ilp(problem)
    choice = {name: sol.choice[g] for name, g in group_of.items()}
    return IntraOpResult(choice, sol, unlinked, len(order))

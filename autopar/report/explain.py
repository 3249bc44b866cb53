"""``plan.explain(...)``: why the solver chose a node's strategy, with the alternatives' costs.

The intra-operator ILP (``solver/intra_op.py``) minimises compute plus resharding over every
node at once, so "why" is answered the way an optimum can be checked: hold every other node at
its chosen strategy and price each strategy of the node's ILP group (the node together with the
same node of every identical layer, and tied parameters: they share one variable). Its compute,
the resharding on its edges to the fixed neighbours, and the device memory it implies. At an
optimal solution no alternative that fits memory is cheaper; ``plan.explain`` shows by how much
each one loses.

The strategy space and its prices stay in memory with a plan made in this process (they are
not saved to JSON): :mod:`autopar.plan_context` keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tabulate import tabulate

from autopar.errors import PlanError
from autopar.plan_context import ExplainContext, context_of
from autopar.placements import to_str

__all__ = ["Alternative", "Explanation", "NodeExplanation", "explain", "explain_node"]


@dataclass(frozen=True)
class Alternative:
    """One strategy of a node's ILP group, with every other node at its chosen strategy.

    ``compute_s`` and ``comm_s`` are summed over the group's nodes; ``memory_bytes`` is the
    device's memory with this strategy; ``fits`` whether that is within the budget.
    """

    outputs: tuple[tuple[str, ...] | None, ...]
    inputs: tuple[tuple[str, ...], ...]
    compute_s: float
    comm_s: float
    memory_bytes: float
    fits: bool
    chosen: bool

    @property
    def total_s(self) -> float:
        """Compute plus communication seconds."""
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class NodeExplanation:
    """The alternatives of one node (cheapest first; the chosen one always among them)."""

    node: str
    op: str
    module: str
    phase: str
    group_size: int
    num_strategies: int
    alternatives: tuple[Alternative, ...]
    stage: int | None = None

    @property
    def chosen(self) -> Alternative:
        """The alternative the solver chose."""
        return next(a for a in self.alternatives if a.chosen)

    def __str__(self) -> str:
        where = f"stage {self.stage}, " if self.stage is not None else ""
        head = (f"{self.node} ({self.op}, {where}module {self.module or '-'}, {self.phase}): "
                f"{self.num_strategies} strategies")
        if self.group_size > 1:
            head += (f"; chosen together with {self.group_size - 1} identical node(s) of other "
                     f"layers or tied parameters, so costs are their sum")
        base = self.chosen.total_s
        fmt = lambda pl: "[" + ", ".join(pl) + "]" if pl is not None else "-"  # noqa: E731
        rows = [["*" if a.chosen else "", " ".join(fmt(o) for o in a.outputs),
                 " ".join(fmt(i) for i in a.inputs), f"{a.compute_s * 1e3:.4f}",
                 f"{a.comm_s * 1e3:.4f}", f"{a.total_s * 1e3:.4f}",
                 "chosen" if a.chosen else f"{(a.total_s - base) * 1e3:+.4f}",
                 f"{a.memory_bytes / 2**20:.1f}", "yes" if a.fits else "no"]
                for a in self.alternatives]
        return head + "\n" + tabulate(rows, headers=[
            "", "outputs per axis", "inputs per axis", "compute ms", "comm ms", "total ms",
            "vs chosen", "device MiB", "fits"])


@dataclass(frozen=True)
class Explanation:
    """``plan.explain(target)``: one :class:`NodeExplanation` per explained node."""

    target: str
    nodes: tuple[NodeExplanation, ...]
    more: int = 0

    def __str__(self) -> str:
        parts = [f"why {self.target!r} is placed as it is (other nodes held at their choice)"]
        parts += [str(n) for n in self.nodes]
        if self.more:
            parts.append(f"... and {self.more} more node(s) in {self.target!r}: explain a node by "
                         f"its name for its alternatives")
        return "\n\n".join(parts)


def _group_costs(ctx: ExplainContext, group: set[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per strategy of ``group``: compute, communication and memory, the rest held fixed."""
    costs, space, choice = ctx.costs, ctx.space, ctx.choice
    first = next(iter(group))
    k = len(space.nodes[first].strategies)
    compute, comm, memory = np.zeros(k), np.zeros(k), np.zeros(k)
    for u in group:
        compute += costs.compute[u]
        memory += costs.memory[u]

    def edge(m: np.ndarray, producer: str, consumer: str) -> None:
        nonlocal comm
        if producer in group and consumer in group:
            comm += np.diagonal(m)
        elif consumer in group:
            comm += m[choice[producer], :]
        elif producer in group:
            comm += m[:, choice[consumer]]

    for (consumer, i), m in costs.edges.items():
        edge(m, space.nodes[consumer].inputs[i][0], consumer)
    for value, param, m in costs.outputs.values():
        if param is None:
            if value[0] in group:
                comm += m
        else:
            edge(m, value[0], param)
    return compute, comm, memory


def explain_node(ctx: ExplainContext, node: str, limit: int, plan_node: Any,
                 stage: int | None = None) -> NodeExplanation:
    """The alternatives of ``node``'s ILP group, cheapest first (at most ``limit`` plus the
    chosen one)."""
    gid = ctx.group_of[node]
    group = {n for n, g in ctx.group_of.items() if g == gid}
    compute, comm, memory = _group_costs(ctx, group)
    chosen = ctx.choice[node]
    base_memory = sum(float(ctx.costs.memory[n][i]) for n, i in ctx.choice.items())
    device = base_memory - memory[chosen] + memory
    txt = lambda pl: tuple(to_str(p) for p in pl) if pl is not None else None  # noqa: E731
    order = sorted(range(len(compute)), key=lambda s: (compute[s] + comm[s], s))
    keep = order[:limit] + ([chosen] if chosen not in order[:limit] else [])
    strategies = ctx.space.nodes[node].strategies
    alts = tuple(Alternative(
        tuple(txt(o) for o in strategies[s].outputs), tuple(txt(i) for i in strategies[s].inputs),
        float(compute[s]), float(comm[s]), float(device[s]),
        ctx.budget is None or device[s] <= ctx.budget * (1 + 1e-9), s == chosen) for s in keep)
    return NodeExplanation(node, plan_node.op, plan_node.module, plan_node.phase, len(group),
                           len(strategies), alts, stage)


def _resolve(plan: Any, target: str) -> list[str]:
    """Nodes of ``plan`` that ``target`` names: a node, a parameter, a module or a layer path
    (its nodes with the most compute first, then the most communication)."""
    ctx = context_of(plan)
    if ctx is not None and target in ctx.space.nodes:
        return [target]
    params = {p.name: p.node for p in ctx.traced.params} if ctx is not None else {}
    if target in params:
        return [params[target]]
    inside = [(name, n) for name, n in plan.nodes.items()
              if n.op not in ("", "placeholder", "getitem")
              and (n.module == target or n.module.startswith(target + ".") or n.layer == target)]
    inside.sort(key=lambda x: (-x[1].compute_s, -x[1].comm_s))  # the matmuls first
    return [name for name, _ in inside]


def explain(plan: Any, target: str | None, max_nodes: int = 4,
            max_alternatives: int = 6) -> Explanation | str:
    """See :meth:`autopar.Plan.explain`."""
    if target is None:
        return _explain_setup(plan)
    plans = ([(j, s) for j, s in enumerate(plan.pipeline.stages)] if plan.pipeline is not None
             else [(None, plan)])
    if not any(context_of(p) for _, p in plans):
        raise PlanError(
            "plan.explain(target) needs the strategy space and prices the solver used; they stay "
            "in memory with a per-operator plan made in this process (not with a plan loaded from "
            "JSON, nor with the planning view of autopar.search). Plan the job with "
            "autopar.plan(model, mesh, example_inputs, config=...) and explain that plan.")
    found: list[tuple[int | None, Any, str]] = []
    for stage, p in plans:
        if context_of(p) is not None:
            found += [(stage, p, n) for n in _resolve(p, target)]
    if not found:
        raise PlanError(f"plan.explain({target!r}): no node, parameter, module or layer of the "
                        f"plan has that name; use a node name from plan.operator_table(expand="
                        f"True), a parameter name, or a module path such as 'blocks.0.attn'.")
    seen, out = set(), []
    for stage, p, n in found:
        key = (stage, context_of(p).group_of[n])
        if key in seen:
            continue
        seen.add(key)
        out.append(explain_node(context_of(p), n, max_alternatives, p.nodes[n], stage))
    return Explanation(target, tuple(out[:max_nodes]), max(len(out) - max_nodes, 0))


def _explain_setup(plan: Any) -> str:
    """The setups the planner compared (degrees and, for a search, schedule and techniques)."""
    rows = [["*", ", ".join(f"{k}={v}" for k, v in plan.techniques.items()), plan.degrees,
             f"{plan.predicted.get('step_time_s', 0.0) * 1e3:.3f}"]]
    rows += [["", a.get("setup", ""), a.get("degrees"), f"{a['step_time_s'] * 1e3:.3f}"]
             for a in plan.alternatives if "step_time_s" in a]
    return ("the setups compared (plan.explain(node_or_module) explains one operator's placement)\n"
            + tabulate(rows, headers=["", "setup", "degrees", "predicted step ms"]))

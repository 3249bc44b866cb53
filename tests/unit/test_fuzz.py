"""Fuzzing with hypothesis.

- Random strategy graphs: the ILP's objective equals brute force's.
- Random MLP and GPT configurations (widths, heads, layers, tied or untied embedding) on random
  virtual meshes of 1 to 4 devices, with the degrees forced or left free: planning twice gives
  the same plan; the per-node costs add up to the plan's prediction; and at the ILP's optimum
  no strategy of any node group is cheaper than the chosen one with the rest held (what
  ``plan.explain`` shows). A configuration that cannot be placed must say why.

The default run keeps the example counts small and derandomised (the suite's time budget, and
no flakiness); ``-m slow`` runs many more. Equivalence with a single process on random
configurations runs on real processes in ``tests/distributed/test_slow.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.plan_context import context_of
from autopar.report.explain import explain_node
from autopar.solver.ilp import brute_force, solve_ilp
from models import build
from test_ilp import random_problem

# ---- the ILP against brute force ---------------------------------------------------------------

_problems = dict(seed=st.integers(0, 2**31 - 1), frac=st.one_of(st.none(), st.floats(0.0, 1.0)))


def _ilp_equals_brute_force(seed: int, frac: float | None) -> None:
    problem = random_problem(seed, frac)  # a budget at frac >= 0 is always feasible
    sol, ref = solve_ilp(problem), brute_force(problem)
    assert sol.status == "optimal"
    # both solve the same finite problem exactly; 1e-6 relative covers the MIP's tolerance
    assert sol.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-12), (seed, frac)
    if problem.memory_budget is not None:
        assert sol.memory_bytes <= problem.memory_budget * (1 + 1e-9)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(**_problems)
def test_ilp_equals_brute_force(seed, frac):
    _ilp_equals_brute_force(seed, frac)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(**_problems)
def test_ilp_equals_brute_force_many(seed, frac):
    _ilp_equals_brute_force(seed, frac)


# ---- random models, meshes and degrees ---------------------------------------------------------

_mlp = st.builds(lambda i, h, o: ("mlp", dict(d_in=i, d_hidden=h, d_out=o)),
                 st.sampled_from([8, 12, 32]), st.sampled_from([16, 24, 64]), st.sampled_from([4, 8]))
_gpt = st.builds(lambda dh, layers, tied: ("gpt", dict(dim=dh[0], heads=dh[1], layers=layers,
                                                       tied=tied, batch=4, seq=8)),
                 st.sampled_from([(16, 2), (24, 3), (32, 4)]), st.integers(1, 3), st.integers(0, 1))
_setups = dict(model=st.one_of(_mlp, _gpt), devices=st.integers(1, 4),
               degrees=st.sampled_from(["free", "tp", "dp"]),
               topology=st.sampled_from(["cpu-gloo", "a100-dgx"]))


def _plan_is_sound(model, devices, degrees, topology) -> None:
    kind, kw = model
    net, inputs = build(kind, **kw)
    mesh = autopar.Mesh.virtual(topology, gpus_per_node=devices)
    config = autopar.Config(pp=1, **({degrees: devices} if degrees != "free" else {}))
    try:
        plan = autopar.plan(net, mesh, inputs, config=config)
    except autopar.PlanError as e:  # e.g. a batch of 8 on dp=3: it must say what to change
        assert "divisible" in str(e) or "cannot be placed" in str(e), str(e)
        return
    again = autopar.plan(net, mesh, inputs, config=config)
    assert again.digest() == plan.digest()  # deterministic
    # per-node costs are the prediction's parts (a few hundred float64 terms: rounding only)
    assert sum(n.compute_s for n in plan.nodes.values()) == pytest.approx(plan.predicted["compute_s"], rel=1e-9)
    assert sum(n.comm_s for n in plan.nodes.values()) == pytest.approx(plan.predicted["comm_s"], rel=1e-9)
    if plan.solver["status"] != "optimal":
        return
    ctx, seen = context_of(plan), set()
    for node in ctx.choice:
        if ctx.group_of[node] not in seen:
            seen.add(ctx.group_of[node])
            ex = explain_node(ctx, node, 10**6, plan.nodes[node])
            best = ex.chosen.total_s
            assert all(a.total_s >= best - 1e-9 * max(best, 1e-6) for a in ex.alternatives if a.fits), \
                (model, devices, degrees, node)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(**_setups)
def test_random_plans_are_deterministic_and_optimal(model, devices, degrees, topology):
    _plan_is_sound(model, devices, degrees, topology)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(**_setups)
def test_random_plans_are_deterministic_and_optimal_many(model, devices, degrees, topology):
    _plan_is_sound(model, devices, degrees, topology)

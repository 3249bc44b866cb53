"""Fuzzing equivalence with hypothesis: random models x meshes x forced or free plans on real
gloo processes, against one process.

Hypothesis draws a world (2 or 4 processes), an MLP (on a tp, dp, dp x tp or free mesh) or a
GPT of random widths and heads, tied or untied embedding, with a setup drawn from the planner's own
space (``setup_space.py``) or the planner free, and a cost topology (``slow-compute`` shards nearly everything, ``a100-dgx`` little); each example
runs in a job started once per world (``conftest.CheckServer``), so hypothesis can also shrink a
failing example to a smaller one. The loss and every gradient must equal a single process's,
and the collectives counted at run time must be the plan's (number and bytes).

The default run draws a few derandomised examples (the suite's time budget); ``-m slow`` draws
many more, each run with a new seed (hypothesis prints the seed and the failing example).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from conftest import FP32_TOL, CheckServer, assert_matches_one_process
from setup_space import as_check, space
from test_equivalence import check_comm_equals_plan

_MESHES = {2: ["tp=2", "dp=2", ""], 4: ["tp=4", "dp=4", "dp=2,tp=2", ""]}
SPACE = {world: space(world) for world in (2, 4)}


@st.composite
def setups(draw: st.DrawFn) -> str:
    """One worker check (``worker.py``): world size, model, and a setup of the planner's own
    space (``setup_space.space``: degrees, microbatches, schedule, v, recomputation, ZeRO,
    sequence parallelism) forced with a Config, or the planner free; and a topology."""
    world = draw(st.sampled_from([2, 4]))
    topo = draw(st.sampled_from(["slow-compute", "a100-dgx"]))
    if draw(st.booleans()):
        model = (f"mlp:d_in={draw(st.sampled_from([8, 12, 32]))},"
                 f"d_hidden={draw(st.sampled_from([16, 24, 64]))},d_out={draw(st.sampled_from([4, 8]))}")
        return f"{world}|{','.join(filter(None, [model, draw(st.sampled_from(_MESHES[world])), f'topo={topo}']))}"
    # 4 heads: every tp degree of the space (2, 4) divides them, so no forced setup is refused
    dim, heads = draw(st.sampled_from([(16, 4), (32, 4), (48, 4), (64, 4)]))
    tied = draw(st.integers(0, 1))
    # the space is enumerated for 4 blocks and a batch of 8 (setup_space.BLOCKS, BATCH)
    model = f"gpt:dim={dim},heads={heads},layers=4,tied={tied},batch=8,seq=8"
    if draw(st.booleans()):
        return f"{world}|{model},topo={topo}"
    return f"{world}|{as_check(draw(st.sampled_from(SPACE[world])), model=model)},topo={topo}"


@pytest.fixture(scope="module")
def servers(results_dir):
    """One check-serving job per world size, started lazily, ended with the module."""
    started: dict[int, CheckServer] = {}

    def get(world: int) -> CheckServer:
        if world not in started:
            out = results_dir / "fuzz"
            out.mkdir(exist_ok=True)
            started[world] = CheckServer(world, out)
        return started[world]

    yield get
    for server in started.values():
        server.close()


def check_equivalence(servers, setup: str) -> None:
    world, check = setup.split("|")
    r = servers(int(world)).run(check)
    # what ran, for --hypothesis-show-statistics
    event(f"{world} processes, {check.split(':')[0]}, "
          + ("pipeline" if "schedule=" in check else "forced mesh" if "p=" in check else "free mesh"))
    if "error" in r:
        event("not placeable (an error that says why)")
        # a configuration that cannot be placed must say why (e.g. heads=3 on tp=2 with no
        # other way to shard); anything else is a failure
        assert "PlanError" in r["error"] and ("divisible" in r["error"] or "cannot be placed" in r["error"]), \
            (setup, r["error"], r.get("trace"))
        return
    # fp32 in both runs (conftest.FP32_TOL: every rank, every parameter)
    assert_matches_one_process(r, FP32_TOL, setup)
    check_comm_equals_plan(setup, r)
    if "params_covered" in r:  # a pipeline: every parameter held somewhere, every one got a gradient
        assert r["params_covered"] == r["ref_n_params"], (setup, r)
        assert r["count_mismatch_ranks"] == 0, (setup, r)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                       HealthCheck.too_slow])


@settings(max_examples=1, derandomize=True, **_SETTINGS)
@given(setup=setups())
# found by the -m slow run (2026-11-25): the free plan sharded one dim with a strided and a plain
# shard on two axes and computed wrong numbers (strategies.space._mixes_strided)
@example(setup="4|gpt:dim=48,heads=4,layers=4,tied=0,batch=8,seq=8,topo=slow-compute")
def test_random_configurations_match_one_process(servers, setup):
    check_equivalence(servers, setup)


@pytest.mark.slow
@settings(max_examples=150, **_SETTINGS)
@given(setup=setups())
def test_random_configurations_match_one_process_many(servers, setup):
    check_equivalence(servers, setup)

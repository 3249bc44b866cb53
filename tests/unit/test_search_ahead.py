"""The search's shortcuts change when it answers, not what: layer costs solved ahead by forked
workers (autopar.planning.ahead) and setups set aside by their memory floor
(step_price.memory_floor) give the same ranking as the search without them.

The model is a 4-layer GPT of 512 hidden on 4 nodes of 8 H100s, batch 64 x 512: its search
has five microbatch sizes (1 to 16 per replica), tp of 1 to 8, pipelines and ZeRO, and many setups
over memory (the budget is cut to 0.4 GiB so that the floor has work to do: 10 setups fit, 978
are priced over it, 123 set aside by the floor).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest

import autopar
import autopar.planning.search as search_mod
from autopar.cost_models.step_price import memory_floor
from autopar.planning.ahead import fork_is_safe
from autopar.model_presets import megatron_gpt
from autopar.planning.search import LayerSolver, layer_key, model_flops, search
from models import build

_BUDGET = 0.4 * 2**30


def _problem():
    model, inputs = megatron_gpt(dict(hidden=512, layers=4, heads=8), batch=64, seq=512)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=4, gpus_per_node=8)
    return model, inputs, mesh, autopar.Config(memory_bytes=_BUDGET)


# (no worker before torch 2.13: ahead.fork_is_safe; the search without them is the one above)
_NEEDS_WORKERS = pytest.mark.skipif(not fork_is_safe(), reason="workers are not started here "
                                    "(torch before 2.13, no fork, or macOS): ahead.fork_is_safe")


def _force_workers(monkeypatch):
    monkeypatch.setattr(search_mod, "AHEAD_AFTER_S", 0.0)
    monkeypatch.setattr(search_mod, "AHEAD_MIN_PARAMS", 0)


def _summary(result):
    rows = lambda cs: [(c.setup, c.step_time_s, c.rank_memory_bytes) for c in cs]  # noqa: E731
    return (rows(result.ranked), rows(result.pruned), result.set_aside, result.bounded,
            result.layer_solves)


_SEARCHES: dict[float, tuple] = {}


def _alone(budget: float):
    """The search without workers at ``budget`` (searched once for the module): at 0.4 GiB
    setups are set aside by their floor and none is skipped by the bound; at 4 GiB setups are
    skipped by the bound and priced late, and none is set aside."""
    if budget not in _SEARCHES:
        model, inputs, mesh, _ = _problem()
        cfg = autopar.Config(memory_bytes=budget)
        layers = LayerSolver(model, inputs, mesh, cfg, (), workers=0)
        _SEARCHES[budget] = layers, search(model, inputs, mesh, cfg, layers=layers), cfg
    return _SEARCHES[budget]


@_NEEDS_WORKERS
@pytest.mark.parametrize("budget", [_BUDGET, 4 * 2**30], ids=["0.4GiB", "4GiB"])
def test_workers_solving_ahead_change_nothing(budget, monkeypatch):
    alone = _alone(budget)
    _, expected, cfg = alone
    assert expected.timings["workers"] == 0
    assert expected.bounded > 0 or expected.over_memory > 0
    model, inputs, mesh, _ = _problem()
    # (this model is small and traces in well under AHEAD_AFTER_S: workers forced for the test)
    _force_workers(monkeypatch)
    search_mod._TRACES.clear()  # (so that the workers trace, not read the cache they inherit)
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=2)  # (two claiming sizes)
    taken = []
    close = search_mod.AheadSolver.close
    monkeypatch.setattr(search_mod.AheadSolver, "close",
                        lambda self: (taken.append(self.delivered), close(self))[1])
    result = search(model, inputs, mesh, cfg, layers=layers)
    assert result.timings["workers"] == 2
    assert taken and taken[0] > 0  # the search used what the workers solved
    assert _summary(result) == _summary(expected)
    # the sizes the workers traced were not traced here again, and their FLOPs (the plan's
    # model_flops) are the ones counted on the traces here
    sizes = {c.setup.microbatch_size for c in expected.ranked + expected.pruned}
    assert len(layers.traces) < len(sizes)
    assert all(model_flops(layers, b) == model_flops(alone[0], b) for b in sizes)
    assert len(layers.traces) < len(sizes)


@_NEEDS_WORKERS
def test_a_worker_that_fails_is_reported_and_its_sizes_solved_by_the_search(monkeypatch):
    model, inputs, mesh, _ = _problem()
    cfg = autopar.Config(tp=1, memory_bytes=2**29)  # (the layer ILPs on one device: cheap)
    expected = search(model, inputs, mesh, cfg,
                      layers=LayerSolver(model, inputs, mesh, cfg, (), workers=0))
    _force_workers(monkeypatch)
    search_mod._TRACES.clear()
    parent, costs = os.getpid(), LayerSolver.costs

    def failing(self, *key, **kw):
        if os.getpid() != parent:
            raise RuntimeError("worker broke")
        return costs(self, *key, **kw)

    monkeypatch.setattr(LayerSolver, "costs", failing)
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = search(model, inputs, mesh, cfg, layers=layers)
    assert result.timings["workers"] == 1
    assert any("worker broke" in str(w.message) for w in seen)
    assert _summary(result) == _summary(expected)


def test_the_memory_floor_is_below_every_price_and_sets_setups_aside():
    layers, result, _ = _alone(_BUDGET)
    assert result.over_memory > 0 and result.ranked
    topo = layers.mesh.topology
    floor = lambda s: memory_floor(layers.costs(*layer_key(s)), s, topo)  # noqa: E731
    for c in result.ranked + result.pruned:
        assert floor(c.setup) <= max(c.rank_memory_bytes) * (1 + 1e-12), c.setup.describe()
    # the setups set aside, priced here: over the floor, over the budget, none priced there
    assert not set(result.set_aside) & {c.setup for c in result.ranked + result.pruned}
    for s in result.set_aside:
        c = search_mod._price_either_split(layers, s, _BUDGET)
        assert floor(s) > _BUDGET and not c.fits and max(c.rank_memory_bytes) >= floor(s)


def test_the_memory_floor_is_below_the_price_of_expert_parallel_setups():
    """Mixtral (4 experts, top-2) on 2 nodes of 8 H100s: every candidate, ep 1, 2 and 4, ZeRO
    0, 1 and 3, pipelines balanced and even; the floor is the state alone, so some are at
    half their price or more (not a floor of zero)."""
    model, inputs = build("mixtral")
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=2, gpus_per_node=8)
    cfg = autopar.Config(memory_bytes=2**20)
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=0)
    topo, seen, close = mesh.topology, set(), 0
    for s in _candidates(layers, cfg)[::2]:
        floor = memory_floor(layers.costs(*layer_key(s)), s, topo)
        for even in (False, True) if s.pp > 1 else (False,):
            c = layers.price(dataclasses.replace(s, even_split=even), 2**20)
            assert floor <= max(c.rank_memory_bytes) * (1 + 1e-12), s.describe()
            close += floor >= 0.5 * max(c.rank_memory_bytes)
        seen.add((s.ep, s.zero))
    assert {e for e, _ in seen} == {1, 2, 4} and {z for _, z in seen} >= {0, 1, 3} and close


def test_nothing_fits_names_the_smallest_need_among_the_setups_set_aside():
    model, inputs, mesh, _ = _problem()
    cfg = autopar.Config(tp=1, memory_bytes=2**20)  # (every setup over its floor)
    with pytest.raises(autopar.InfeasibleMemoryError) as e:
        search(model, inputs, mesh, cfg)
    # every setup was priced for the error: the smallest need is the least of all of theirs
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=0)
    least = min(max(search_mod._price_either_split(layers, s, 2**20).rank_memory_bytes)
                for s in _candidates(layers, cfg))
    assert e.value.required_bytes == pytest.approx(least, rel=1e-12)


def _candidates(layers, cfg):
    """The setups the search prices (sequence parallelism only where it splits something)."""
    from autopar.planning.setups import candidate_setups

    return [s for s in candidate_setups(layers.mesh.size, layers.mesh.topology.gpus_per_node,
                                        layers.batch, layers.num_blocks, cfg, seq=layers.seq,
                                        experts=layers.num_experts)
            if not (s.sequence_parallel and not layers.shards_sequence(s.microbatch_size))]


_AFTER_THREADS = """
import torch
import autopar
import autopar.planning.search as S
from models import build

x = torch.randn(2048, 1024)
torch.nn.functional.layer_norm(x @ x.T, (2048,))  # (this process's OpenMP threads started)
S.AHEAD_AFTER_S, S.AHEAD_MIN_PARAMS = 0.0, 0
model, inputs = build("gpt", dim=64, layers=2, batch=16, seq=32)
mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=4)
cfg = autopar.Config(mixed_precision="bf16")
res = S.search(model, inputs, mesh, cfg, layers=S.LayerSolver(model, inputs, mesh, cfg, (), workers=1))
assert res.timings["workers"] == 1
"""


@_NEEDS_WORKERS
def test_a_worker_forked_after_the_parent_ran_threaded_kernels_does_not_hang():
    """A real model's bf16 trace runs its stages on real tensors; in a child forked after the
    parent's OpenMP threads started, a kernel starting a team of them waited forever for threads
    the fork does not copy (a CLI test hung so). The worker runs on one thread now. In its own
    process, so that a hang fails the test after two minutes instead of hanging the suite."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(here, ".."),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _AFTER_THREADS], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


_DIES_IN_A_MESSAGE = """
import os, struct, warnings
import autopar
import autopar.planning.ahead as ahead
import autopar.planning.search as S
from autopar.model_presets import megatron_gpt

def dies_while_writing(conn, message):  # (in the worker's sending thread)
    if message[1] == "costs" and HOW == "half":  # half a frame of the pipe, then the end
        os.write(conn.fileno(), struct.pack("!i", 1 << 20) + b"part of a message")
        os._exit(9)
    if message[1] == "costs":  # (the sending thread fails: the worker ends, exit code 1)
        raise TypeError("a message that does not pickle")
    conn.send(message)

ahead._write_message = dies_while_writing
S.AHEAD_AFTER_S, S.AHEAD_MIN_PARAMS = 0.0, 0
model, inputs = megatron_gpt(dict(hidden=512, layers=4, heads=8), batch=64, seq=512)
mesh = autopar.Mesh.virtual("h100-dgx", nodes=4, gpus_per_node=8)
cfg = autopar.Config(tp=1, memory_bytes=2**29)
summary = lambda r: [(c.setup, c.step_time_s, c.rank_memory_bytes) for c in r.ranked]
expected = S.search(model, inputs, mesh, cfg, layers=S.LayerSolver(model, inputs, mesh, cfg, (), workers=0))
S._TRACES.clear()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    result = S.search(model, inputs, mesh, cfg, layers=S.LayerSolver(model, inputs, mesh, cfg, (), workers=1))
said = [str(w.message) for w in seen]
assert result.timings["workers"] == 1
assert any(f"worker 1 stopped (exit code {9 if HOW == 'half' else 1})" in m for m in said), said
assert summary(result) == summary(expected)
"""


@_NEEDS_WORKERS
@pytest.mark.parametrize("how", ["half", "unpicklable"])
def test_a_worker_that_dies_in_the_middle_of_a_message_does_not_hang_the_search(how):
    """A worker killed while it writes a message (the OOM killer, say) leaves half of it in
    the pipe: the search reads to the pipe's end, warns and solves that worker's sizes itself,
    with the ranking it has alone. (Through one queue shared by the workers it waited for the
    rest of the message forever.) A message its sending thread cannot write ends the worker
    too. In its own process, so that a hang fails the test after five minutes instead of
    hanging the suite."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(here, ".."),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"HOW = {how!r}\n" + _DIES_IN_A_MESSAGE],
                          env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

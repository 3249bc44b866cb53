"""Distinct pipeline stages placed by forked workers (autopar.planning.stage_workers) give the
plan placing them in order gives, explained the same; a worker that fails or dies leaves its
stages to the planner, with a warning, and a worker's warnings are raised in the planner;
stages pinned by a tied weight are not sent out."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import autopar
from autopar.planning import pipeline
from autopar.planning import stage_workers
from autopar.planning.ahead import fork_is_safe
from models import GPT
from plan_equality import assert_same_pipeline_plan

FOUR = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=4)
# four stages of a 6-block GPT on 2 ranks (interleaved): 3 distinct stage graphs (first, middle, last)
_CFG = autopar.Config(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatch_size=1)

_NEEDS_FORK = pytest.mark.skipif(not fork_is_safe(), reason="workers are not started here "
                                 "(torch before 2.13, no fork, or macOS): ahead.fork_is_safe")


def _model(tied: int = 0):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 16))
    return GPT(vocab=64, dim=32, heads=2, layers=6, seq=16, tied=tied), (ids, ids)


def _plan(monkeypatch, workers: int, tied: int = 0, spy: list | None = None,
          procs: list | None = None):
    """The plan with ``workers`` stage workers; ``spy`` gets (jobs, workers started),
    ``procs`` the workers' processes."""
    model, inputs = _model(tied)
    monkeypatch.setattr(pipeline, "worker_count", lambda m: workers)
    real = stage_workers.StageWorkers

    def counted(jobs, n, limit):
        out = real(jobs, n, limit)
        if spy is not None:
            spy.append((len(jobs), len(out.procs)))
        if procs is not None:
            procs.extend(out.procs)
        return out

    monkeypatch.setattr(pipeline, "StageWorkers", counted)
    pipeline._LAST_STAGES.clear()
    try:
        return autopar.plan(model, FOUR, inputs, config=_CFG)
    finally:
        pipeline._LAST_STAGES.clear()


_ALONE: dict = {}


def _alone(monkeypatch, tied: int = 0):
    """The plan placing the stages in order (made once for the module)."""
    if tied not in _ALONE:
        _ALONE[tied] = _plan(monkeypatch, 0, tied=tied)
    return _ALONE[tied]


@_NEEDS_FORK
def test_stages_placed_by_workers_are_the_plan_placed_in_order(monkeypatch):
    alone = _alone(monkeypatch)
    spy = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no worker may have failed)
        forked = _plan(monkeypatch, 2, spy=spy)
    assert spy == [(2, 2)]  # (the middle and last stage graphs, each in a worker of its own)
    assert_same_pipeline_plan(forked, alone)
    # their strategy spaces were not sent back: the explanation makes them again
    for target in ("blocks.3.qkv", "head", "blocks.0.fc1"):  # (a middle, the last, the first stage)
        got = forked.explain(target)
        assert got.nodes and got == alone.explain(target), target


@_NEEDS_FORK
def test_a_stage_pinned_by_a_tied_weight_stays_with_the_planner(monkeypatch):
    spy = []
    forked = _plan(monkeypatch, 2, tied=1, spy=spy)
    # the last stage reads the embedding the first one places: only the middle one goes out
    assert spy == [(1, 1)]
    assert_same_pipeline_plan(forked, _alone(monkeypatch, tied=1))


@_NEEDS_FORK
@pytest.mark.parametrize("how", ["raises", "dies", "warns", "does-not-pickle"])
def test_a_failed_worker_leaves_its_stages_to_the_planner(monkeypatch, how, tmp_path):
    alone = _alone(monkeypatch)
    parent = os.getpid()
    real = pipeline.solve_candidate

    def failing(*args, **kwargs):
        worker = os.getpid() != parent
        if worker:  # (the planner takes the worker's second stage if it has not begun it)
            (tmp_path / f"worker{kwargs['stage']}").write_text("")
        if worker and how == "dies":
            os._exit(3)
        if worker and how == "raises":
            raise RuntimeError("a stage worker's error")
        if worker and how == "warns":
            warnings.warn("a warning in a worker", UserWarning)
        plan = real(*args, **kwargs)
        if worker and how == "does-not-pickle":
            plan.solver["callback"] = lambda: None
        if not worker and kwargs["stage"] == 0:  # (the worker has begun its first stage, a
            # minute at most, so that the planner does not take both)
            deadline = time.monotonic() + 60
            while not (tmp_path / "worker1").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return plan

    monkeypatch.setattr(pipeline, "solve_candidate", failing)
    procs: list = []
    with pytest.warns(Warning) as caught:
        forked = _plan(monkeypatch, 1, procs=procs)
    said = [str(w.message) for w in caught]
    if how == "warns":  # (the worker's warnings, raised here: one per stage it placed)
        placed = len(list(tmp_path.glob("worker*")))
        assert placed >= 1 and said == ["a warning in a worker"] * placed
    elif how == "does-not-pickle":  # (its first stage's plan; the worker then stops, code 1)
        assert any("did not place stage graph" in m and "its plan could not be sent" in m
                   for m in said), said
        assert [p.exitcode for p in procs] == [1]
    else:
        expected = "a stage worker's error" if how == "raises" else "exit code 3"
        assert any("did not place stage graph" in m and expected in m for m in said), said
    assert_same_pipeline_plan(forked, alone)


@_NEEDS_FORK
def test_a_worker_starts_its_next_stage_before_the_planner_reads_the_last(monkeypatch, tmp_path):
    parent = os.getpid()
    real = pipeline.solve_candidate

    def solve(*args, **kwargs):
        plan = real(*args, **kwargs)
        if os.getpid() == parent:  # (the planner's own stage, the first: it waits for the
            # worker to start its second stage, a minute at most, before it reads any plan)
            deadline = time.monotonic() + 60
            while not (tmp_path / "started3").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            (tmp_path / "waited").write_text(str((tmp_path / "started3").exists()))
        elif kwargs["stage"] == 1:  # (more than a pipe holds: its write waits for a read)
            plan.solver["padding"] = "x" * 4_000_000
        else:
            (tmp_path / f"started{kwargs['stage']}").write_text("")
        return plan

    monkeypatch.setattr(pipeline, "solve_candidate", solve)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no worker may have failed)
        forked = _plan(monkeypatch, 1)
    # the worker holds the middle and last stage graphs (stages 1 and 3): it began the last
    # while the planner had not read the middle one's plan, which came whole
    assert (tmp_path / "waited").read_text() == "True"
    assert len(forked.pipeline.stages[1].solver["padding"]) == 4_000_000


@_NEEDS_FORK
@pytest.mark.parametrize("how", ["places", "raises"])
def test_the_planner_takes_a_stage_its_worker_has_not_begun(monkeypatch, tmp_path, how):
    # one worker holds the middle and last stage graphs (stages 1 and 3); its middle one waits
    # (a minute at most) for the planner to place the last one itself, which it does only if
    # it takes the job the worker has not begun instead of waiting for the worker; the
    # planner's warning there comes with the plan, its error when the last stage's turn comes
    alone = _alone(monkeypatch)
    parent = os.getpid()
    real = pipeline.solve_candidate

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def solve(*args, **kwargs):
        who = "planner" if os.getpid() == parent else "worker"
        if who == "worker" and kwargs["stage"] == 1:
            (tmp_path / "began1").write_text("")
            wait_for("planner3")
        if who == "planner" and kwargs["stage"] == 3:
            (tmp_path / "planner3").write_text("")
            warnings.warn("the planner's stage 3", UserWarning)
            if how == "raises":
                raise ValueError("the planner's stage 3 failed")
        plan = real(*args, **kwargs)
        if who == "planner" and kwargs["stage"] == 0:  # (the worker has begun its first job)
            wait_for("began1")
        (tmp_path / f"{who}{kwargs['stage']}").write_text("")
        return plan

    monkeypatch.setattr(pipeline, "solve_candidate", solve)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "raises":
            with pytest.raises(ValueError, match="stage 3 failed"):
                _plan(monkeypatch, 1)
        else:
            forked = _plan(monkeypatch, 1)
    said = [str(w.message) for w in caught]
    assert said.count("the planner's stage 3") == 1
    assert not [m for m in said if "stage worker" in m], said  # (no worker failed)
    expected = ["began1", "planner0", "planner3", "worker1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    if how == "places":
        assert_same_pipeline_plan(forked, alone)

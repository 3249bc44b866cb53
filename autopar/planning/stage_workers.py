"""Distinct pipeline stages placed at once, in worker processes forked from the planner.

A pipelined plan solves one intra-operator ILP per distinct stage graph
(:func:`~autopar.planning.pipeline.build_pipeline_plan`): DeepSeek-V3 on 2,048 GPUs has three
(the first stage with the embedding and dense layers, a middle one, the last with the head),
each its strategy space, prices and ILP, 11 to 22 s on this project's 2-core CI machine, one
after the other. Those that read no weight an earlier stage reads (a tied embedding pins the
last stage to the first stage's placement) do not depend on one another: workers forked
after the stages are traced solve them while the planner solves the first, and send each
:class:`~autopar.plan.Plan` back. The planner takes a stage's plan when it comes to that stage,
so the plan is the one solving them in order gives (the solves are deterministic, as long as
no ILP stops at ``Config.solver_time_limit_s``, whose best-so-far the machine's load changes).

Workers are forked where :func:`~autopar.planning.ahead.fork_is_safe` allows it, for models of
:data:`~autopar.planning.search.AHEAD_MIN_PARAMS` parameters or more (forking costs tens of
milliseconds, a small stage's solve less), at most :func:`~autopar.planning.ahead.
default_workers` of them, each taking every so many of the stages in turn. A worker that fails
(an error, a plan that does not pickle, its death, silence past its solves' time limits) leaves
its stages to the planner, which solves them itself (a real error is raised there, with its
traceback) and warns with the worker's message. A stage's strategy space is not sent back (it
does not pickle): the plan's explanation (``plan.explain``) makes it again when asked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import warnings
from typing import Any, Callable, Hashable, Sequence

import torch.nn as nn

from autopar.planning.ahead import default_workers, fork_is_safe
from autopar.planning.stage_reuse import stage_key
from autopar.plan_context import context_of

__all__ = ["MIN_PARAMS", "StageWorkers", "independent_jobs", "worker_count"]

# workers are forked for models of this many parameters or more: forking the planner and
# sending a plan back costs tens of milliseconds, a small model's stage solves less
MIN_PARAMS = 10**9
# a worker silent for this long plus its stages' ILP time limits is stopped
_SILENCE_S = 600.0


def worker_count(model: nn.Module) -> int:
    """Stage workers for ``model``: :func:`default_workers` from :data:`MIN_PARAMS` on, else 0."""
    return default_workers() if sum(p.numel() for p in model.parameters()) >= MIN_PARAMS else 0


def independent_jobs(stages: Sequence[tuple[Any, Any]], shapes: Sequence[Hashable],
                     canonical: dict[str, str], job: Callable[..., Callable[[], Any]]
                     ) -> list[tuple[Hashable, Callable[[], Any]]]:
    """The solves workers may take: one per distinct stage graph (``stage_key`` with nothing
    pinned) whose stage reads no weight an earlier stage reads (by the model's name for it,
    ``canonical``), but the first (the planner's own); ``job(stage, traced, shape, fixed)``
    is the solve the planner would run for it."""
    seen: set[str] = set()
    keys: set[Hashable] = set()
    out = []
    for (st, traced), shape in zip(stages, shapes):
        names = {canonical.get(p.name, p.name) for p in traced.params}
        free, seen = not names & seen, seen | names
        key = stage_key(traced, {})
        if free and key not in keys:
            keys.add(key)
            out.append((key, job(st, traced, shape, {})))
    return out[1:]


class StageWorkers:
    """Up to ``workers`` processes forked now (where :func:`fork_is_safe`), each computing
    ``jobs`` (key -> a function returning a stage's plan) in turn, one every ``workers``.
    :meth:`plan` gives a key's plan; close with :meth:`close`."""

    def __init__(self, jobs: Sequence[tuple[Hashable, Callable[[], Any]]], workers: int,
                 time_limit_s: float) -> None:
        self._where: dict[Hashable, int] = {}
        self._conns: dict[int, Any] = {}
        self._ready: dict[Hashable, tuple] = {}
        self._lost: dict[Hashable, str] = {}
        self.procs: list[Any] = []
        ctx = mp.get_context("fork") if jobs and workers > 0 and fork_is_safe() else None
        count = min(workers, len(jobs)) if ctx is not None else 0
        self._silence_s = _SILENCE_S + 2 * time_limit_s * -(-len(jobs) // max(count, 1))
        for i in range(count):
            mine = list(jobs[i::count])
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_work, daemon=True,
                            args=(mine, writer, [reader, *self._conns.values()]))
            try:
                p.start()
            except OSError as e:  # (out of processes or memory: the planner solves them)
                warnings.warn(f"autopar: a stage worker could not start ({e}); the planner "
                              f"places its stages itself.", RuntimeWarning, stacklevel=2)
                reader.close()
                writer.close()
                break
            writer.close()  # (the worker holds the only writing end: its death ends the pipe)
            self._conns[i] = reader
            self.procs.append(p)
            self._where.update({key: i for key, _ in mine})

    def plan(self, key: Hashable, solve: Callable[[], Any]) -> tuple[Any, dict[str, int] | None]:
        """``key``'s plan and its ILP's choice, from its worker, or ``(solve(), None)`` when
        no worker has it or its worker failed (told with a warning)."""
        if key in self._where:
            self._wait(key)
            if key in self._ready:
                return self._ready.pop(key)
            warnings.warn(f"autopar: a stage worker did not place stage graph {key!r:.40} "
                          f"({self._lost[key]}); the planner places it itself.",
                          RuntimeWarning, stacklevel=2)
        return solve(), None

    def close(self) -> None:
        """Stop the workers still running."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join()
        for conn in self._conns.values():
            conn.close()
        self.procs, self._conns = [], {}

    def _wait(self, key: Hashable) -> None:
        """Read ``key``'s worker's messages until ``key``'s plan or failure has come."""
        i = self._where[key]
        conn = self._conns.get(i)
        while key not in self._ready and key not in self._lost:
            try:
                if conn is None or not conn.poll(self._silence_s):
                    raise EOFError(f"silent for {self._silence_s:.0f} s")
                got, status, *rest = conn.recv()
            except (EOFError, OSError) as e:
                why = f"it ended without sending it ({e or 'its pipe closed'})"
                for k, j in self._where.items():
                    if j == i and k not in self._ready:
                        self._lost.setdefault(k, why)
                continue
            if status == "ok":
                self._ready[got] = tuple(rest)
            else:
                self._lost[got] = rest[0]


def _work(jobs: list[tuple[Hashable, Callable[[], Any]]], writer: Any, others: list[Any]) -> None:
    """A worker: compute each job and send ``(key, "ok", plan, choice)`` or ``(key, "failed",
    message)``; the reading ends it inherited are closed (a planner that died leaves no pipe
    held open by its worker)."""
    import torch

    # (no OpenMP team here: the parent's pool of threads is not in the fork)
    torch.set_num_threads(1)
    for conn in others:
        conn.close()
    for key, job in jobs:
        t0 = time.perf_counter()
        try:
            plan = job()
            ctx = context_of(plan)
            message = (key, "ok", plan, dict(ctx.choice) if ctx is not None else None)
        except Exception as e:  # (told to the planner, which solves the stage itself)
            text = str(e).strip().splitlines()
            message = (key, "failed", f"{type(e).__name__}: {text[0] if text else ''} "
                                      f"after {time.perf_counter() - t0:.1f} s")
        try:
            writer.send(message)
        except Exception as e:  # (a plan that does not pickle: the planner solves the rest)
            writer.send((key, "failed", f"its plan could not be sent: {type(e).__name__}: {e}"))
            os._exit(1)
    writer.close()

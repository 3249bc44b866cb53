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
default_workers` of them, each taking every so many of the stages in turn; a job no worker
has begun when the planner would wait for one is taken by the planner (marked in a shared
array, so that exactly one process solves it), which is otherwise idle then: on two CPUs,
DeepSeek-V3's last stage is placed by the planner while its worker places the middle one. A
worker that fails (an error, a plan that does not pickle, its death, silence past its solves'
time limits) leaves the stages it had begun or finished unsent to the planner, which solves
them itself (a real error is raised there, with its traceback) and warns with the worker's
message; those it had not begun the planner takes at their turn, without a warning. A stage's
strategy space is not sent back (it does not pickle): the plan's explanation
(``plan.explain``) makes it again when asked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Hashable, Sequence

import torch.nn as nn

from autopar.errors import PlanError
from autopar.planning.ahead import default_workers, fork_is_safe, sending
from autopar.planning.solve import explain_context
from autopar.planning.stage_reuse import stage_key
from autopar.plan_context import context_of

__all__ = ["MIN_PARAMS", "StageWorkers", "explained", "independent_jobs", "worker_count"]

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
        self._proc: dict[int, Any] = {}
        self._jobs = list(jobs)
        self._mine: dict[Hashable, Any] = {}  # (plans of the jobs the planner took itself)
        self.procs: list[Any] = []
        ctx = mp.get_context("fork") if jobs and workers > 0 and fork_is_safe() else None
        count = min(workers, len(jobs)) if ctx is not None else 0
        self._silence_s = _SILENCE_S + 2 * time_limit_s * -(-len(jobs) // max(count, 1))
        # who took each job (0: nobody yet, else _PLANNER or _WORKER), under its lock
        self._taken = ctx.Array("b", len(self._jobs)) if count else None
        try:
            for i in range(count):
                if not self._start(ctx, i, list(range(i, len(self._jobs), count))):
                    break
        except BaseException:  # (no worker left behind by an interrupted start)
            self.close()
            raise

    def _start(self, ctx: Any, i: int, mine: list[int]) -> bool:
        """Fork worker ``i`` for the jobs at ``mine``; False (with a warning) if it cannot
        start."""
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_work, daemon=True,
                        args=([(j, *self._jobs[j]) for j in mine], self._taken, writer,
                              [reader, *self._conns.values()]))
        try:
            p.start()
        except OSError as e:  # (out of processes or memory: the planner solves them)
            warnings.warn(f"autopar: a stage worker could not start ({e}); the planner "
                          f"places its stages itself.", RuntimeWarning, stacklevel=3)
            reader.close()
            writer.close()
            return False
        writer.close()  # (the worker holds the only writing end: its death ends the pipe)
        self._conns[i] = reader
        self._proc[i] = p
        self.procs.append(p)
        self._where.update({self._jobs[j][0]: i for j in mine})
        return True

    def plan(self, key: Hashable, solve: Callable[[], Any]) -> tuple[Any, dict | None]:
        """``key``'s plan and what its worker sends with it (:func:`_work`), or ``(solve(),
        None)`` when no worker has it, its worker failed (told with a warning) or had not
        begun it (the planner takes it then). The warnings the worker's solve raised are
        raised here. While it would wait for a worker, the planner solves, one at a time, the
        jobs no worker has begun (which it would otherwise solve after waiting); their
        warnings and errors are raised when their turn comes, as a worker's are."""
        if key in self._mine:
            (plan, error), caught = self._mine.pop(key)
            for message, category in caught:
                warnings.warn(message, category, stacklevel=2)
            if error is not None:
                raise error
            return plan, None
        if key in self._where and self._take(key):
            return solve(), None
        if key in self._where:
            while not self._arrived(key) and self._take_one():
                pass
            self._wait(key)
            if key in self._ready:
                plan, extra, caught = self._ready.pop(key)
                for message, category in caught:
                    warnings.warn(message, category, stacklevel=2)
                return plan, extra
            warnings.warn(f"autopar: a stage worker did not place stage graph {str(key)[:12]} "
                          f"({self._lost[key]}); the planner places it itself.",
                          RuntimeWarning, stacklevel=2)
        return solve(), None

    def _take(self, key: Hashable) -> bool:
        """Whether the planner takes ``key``'s job (no worker has begun it)."""
        j = next(j for j, (k, _) in enumerate(self._jobs) if k == key)
        return _take(self._taken, j, _PLANNER)

    def _arrived(self, key: Hashable) -> bool:
        """Whether ``key``'s worker has a message waiting (or ended), so reading costs nothing."""
        conn = self._conns.get(self._where[key])
        return key in self._ready or key in self._lost or conn is None or conn.poll(0)

    def _take_one(self) -> bool:
        """Solve here the first job no worker has begun, keeping its plan or error and its
        warnings for its turn; whether there was one."""
        for key, job in self._jobs:
            if key in self._where and key not in self._mine and key not in self._ready \
                    and key not in self._lost and self._take(key):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        done: tuple = (job(), None)
                    except Exception as e:  # (raised at its turn: plan)
                        done = (None, e)
                self._mine[key] = (done, [(str(w.message), w.category) for w in caught])
                return True
        return False

    def close(self) -> None:
        """Stop the workers still running."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
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
                    raise TimeoutError(f"silent for {self._silence_s:.0f} s: stopped")
                got, status, *rest = conn.recv()
            except (EOFError, OSError) as e:
                proc = self._proc.get(i)
                if proc is not None and proc.is_alive():
                    proc.terminate()  # (silent: the planner does its work now)
                    proc.join(5)
                code = f", exit code {proc.exitcode}" if proc is not None else ""
                why = f"it ended without sending it ({str(e) or 'its pipe closed'}{code})"
                for k, j in self._where.items():
                    if j == i and k not in self._ready:
                        self._lost.setdefault(k, why)
                continue
            if status == "ok":
                self._ready[got] = tuple(rest)
            else:
                self._lost[got] = rest[0]


_PLANNER, _WORKER = 1, 2


# how long the planner waits for the claims' lock (held for a few instructions; a worker killed
# while holding it would hold it for ever): past it, the planner does not take the job
_LOCK_S = 60.0


def _take(taken: Any, j: int, who: int) -> bool:
    """Whether ``who`` takes job ``j`` (nobody had): marked in the shared array ``taken``."""
    lock = taken.get_lock()
    if not lock.acquire(timeout=_LOCK_S):
        return False  # (the job's worker, or the planner after it, solves it)
    try:
        if taken[j]:
            return False
        taken[j] = who
        return True
    finally:
        lock.release()


def _work(jobs: list[tuple[int, Hashable, Callable[[], Any]]], taken: Any, writer: Any,
          others: list[Any]) -> None:
    """A worker: compute each job (index, key, function) the planner has not taken, and send
    ``(key, "ok", plan, extra, warnings)`` (``extra``: the ILP's choice and each node's
    strategy count, for the explanation; ``warnings``: those the solve raised, as message and
    category) or ``(key, "failed", message)``, each pickled here and written by a thread
    (:func:`~autopar.planning.ahead.sending`), so that the next job starts while the planner
    has not read the last (a pipe holds 64 KiB on Linux, a plan more); the reading ends it
    inherited are closed (a planner that died leaves no pipe held open by its worker)."""
    import torch

    # (no OpenMP team here: the parent's pool of threads is not in the fork)
    torch.set_num_threads(1)
    for conn in others:
        conn.close()
    outbox: queue.Queue = queue.Queue()
    sent = True
    sender = threading.Thread(target=sending, args=(writer, outbox), daemon=True)
    sender.start()
    try:
        for j, key, job in jobs:
            if not _take(taken, j, _WORKER):
                continue  # (the planner took it while it waited for another)
            data, sent = _message(key, job)
            outbox.put(data)
            if not sent:  # (a plan that does not pickle: the planner solves the rest)
                break
    finally:
        outbox.put(None)
        sender.join()
    if not sent:  # (a failure's exit code, which the planner's warning for the rest tells)
        os._exit(1)


def _message(key: Hashable, job: Callable[[], Any]) -> tuple[bytes, bool]:
    """``job``'s message for the planner, pickled, and whether it holds the plan."""
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = job()
        ctx = context_of(plan)
        extra = {"choice": dict(ctx.choice), "strategies": _counts(ctx)} if ctx else None
        message = (key, "ok", plan, extra, [(str(w.message), w.category) for w in caught])
    except Exception as e:  # (told to the planner, which solves the stage itself)
        text = str(e).strip().splitlines()
        message = (key, "failed", f"{type(e).__name__}: {text[0] if text else ''} "
                                  f"after {time.perf_counter() - t0:.1f} s")
    try:
        return bytes(ForkingPickler.dumps(message)), True
    except Exception as e:
        return bytes(ForkingPickler.dumps(
            (key, "failed", f"its plan could not be sent: {type(e).__name__}: {e}"))), False


def _counts(ctx: Any) -> dict[str, int]:
    """How many strategies each node of a solved stage had (what its choice indexes)."""
    return {n: len(s.strategies) for n, s in ctx.space.nodes.items()}


def explained(solve: Any, extra: dict) -> Any:
    """The explanation context of a stage a worker placed, made again here from its solve's
    arguments (``solve``: a ``functools.partial`` of ``solve_candidate``) and the worker's
    choice; refused (PlanError) if the strategy space made again is not the one the worker's
    choice indexes (a time-limited pinning ILP may land elsewhere on another run)."""
    ctx = explain_context(*solve.args, choice=extra["choice"], **solve.keywords)
    if _counts(ctx) != extra["strategies"]:
        raise PlanError("plan.explain: this pipeline stage was placed by a worker process, and "
                        "its strategy space made again here differs from the one it solved; "
                        "plan again to explain it (or plan a smaller model, placed in order).")
    return ctx

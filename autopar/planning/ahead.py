"""Layer costs solved ahead of the search, in worker processes forked from it.

The setup search (:mod:`autopar.planning.search`) traces its two-block copy once per microbatch
size and solves one layer ILP per :func:`~autopar.planning.search.layer_key`; it asks for them in
order, the smallest microbatch first, pricing setups in between. On a large model a trace takes
seconds (DeepSeek-V3's: about 4.5 s in ``torch.export`` and the joint graph, on this project's
2-core CI machine) and the search is mostly that work, one core at a time.

Workers forked from the search take the largest microbatch sizes not yet claimed, trace each,
solve every key of that size the search can ask for without context parallelism (those with cp
stay with the search: its bound skips most of them), and send each
:class:`~autopar.cost_models.training_step.LayerCosts` back. The search claims a size when it
traces one itself. It reads a worker's result only when it asks for that key, so what it prices,
skips and ranks is what it would without workers: they change when, not what (as long as each
layer ILP finishes within ``Config.solver_time_limit_s``: one stopped by the limit keeps its best
plan so far, which the machine's load can change, with or without workers).

A worker that fails on a size sends its error; the search then computes that size itself (so a
real error is raised there, with its traceback) and warns with the worker's message. Each worker
writes to a pipe of its own, which only it holds open (a sending thread, so that it never waits
for the search to read): a worker that dies, even in the middle of a message, ends its pipe, and
the search solves its sizes (one queue shared by all workers would be left holding part of a
message, and the search would wait for the rest forever). Workers need
the ``fork`` start method (the model, possibly under ``FakeTensorMode``, is shared with them, not
pickled); none is started without it, on macOS (where forking a process that has started
threads is unsafe), inside a process group (a fork would share its sockets), in a daemonic
process, once CUDA is initialized (a forked child cannot use it) or on one CPU. A worker silent
for longer than its sizes' ILPs may take is stopped, and its sizes are solved by the search.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import queue
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["AheadSolver", "LayerKey", "TraceFacts", "default_workers", "fork_is_safe", "sending"]

LayerKey = tuple[int, int, bool, int, bool]  # (tp, b, sp, cp, cp inside tp): search.layer_key

# A worker silent for this long plus twice its sizes' ILP time limits (while alive) is stopped,
# its sizes solved by the search: DeepSeek-V3's trace takes about 5 s, its layer ILPs 0.1-5 s
_SILENCE_S = 600.0


@dataclass(frozen=True)
class TraceFacts:
    """What the search reads from a microbatch size's trace besides its layer ILPs: whether
    sequence parallelism splits anything (``LayerSolver.shards_sequence``) and the model's FLOPs
    for one microbatch (``search.model_flops``; a worker counts them, the search only when
    asked)."""

    shards_sequence: bool
    flops: float | None = None  # (None: not counted yet)


def fork_is_safe() -> bool:
    """Whether this process may fork workers: torch 2.13 or later, the ``fork`` start method,
    not on macOS, outside a process group and a daemonic process, and before CUDA is
    initialized. torch 2.11 refuses autograd in a process forked after its parent ran a
    backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"), as the search's own first trace does; 2.12 is not checked."""
    import torch
    import torch.distributed as dist

    from autopar import _torch_private as private

    if private.older_than("2.13"):
        return False
    if "fork" not in mp.get_all_start_methods() or sys.platform == "darwin":
        return False
    if dist.is_available() and dist.is_initialized() or mp.current_process().daemon:
        return False  # (a daemonic process may not start others)
    return not torch.cuda.is_initialized()  # (CUDA cannot be used again in a forked child)


def default_workers() -> int:
    """Workers to start by default: one fewer than the CPUs this process may use, at most 7
    (the search takes the smallest microbatch sizes itself)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(7, (cpus or 1) - 1))


class AheadSolver:
    """Up to ``workers`` processes forked now (where :func:`fork_is_safe`), solving ``keys`` of
    ``solver`` (a :class:`~autopar.planning.search.LayerSolver`), the largest microbatch sizes
    first. ``time_limit_s``: a layer ILP's time limit (``Config.solver_time_limit_s``), which
    sets how long a worker may stay silent.

    ``skip_unsplit``: the keys with sequence parallelism are solved only where the trace has
    something for it to split (the search skips them otherwise; pass False when forced).
    Close with :meth:`close` (the workers still busy are stopped)."""

    def __init__(self, solver: Any, keys: Sequence[LayerKey], workers: int,
                 skip_unsplit: bool = True, time_limit_s: float = 30.0) -> None:
        self.sizes = sorted({k[1] for k in keys})
        self.keys = {b: sorted({k for k in keys if k[1] == b}) for b in self.sizes}
        ctx = mp.get_context("fork") if fork_is_safe() else None
        # per size: 0 free, -1 the search's, i > 0 worker i's
        self._claims = (ctx or mp).Array("i", len(self.sizes))
        self._conns: dict[int, Any] = {}  # worker -> the end of its pipe the search reads
        self._out: Any = None  # (in a worker: its pipe's writing end)
        self._in: Any = None  # (in a worker: its pipe's reading end, closed there)
        self._outbox: Any = None  # (in a worker: the messages its sending thread writes)
        self._ready: dict[LayerKey, tuple[Any, float]] = {}
        self._facts: dict[int, tuple[TraceFacts, float]] = {}
        self._failed: dict[int, str] = {}
        self._done: set[int] = set()  # sizes a worker has sent all it will send of
        self.skip_unsplit = skip_unsplit
        self.delivered = 0  # results the search took from the workers
        most = max((len(k) for k in self.keys.values()), default=0)
        self._silence_s = _SILENCE_S + 2 * time_limit_s * most
        self.procs: list[Any] = []
        for i in range(workers if ctx is not None else 0):
            reader, writer = ctx.Pipe(duplex=False)
            self._out, self._in = writer, reader  # (the ends of the worker forked now)
            p = ctx.Process(target=_work, daemon=True, args=(solver, self, i + 1, skip_unsplit))
            try:
                p.start()
            except OSError as e:  # (out of processes or memory: fewer workers, or none)
                warnings.warn(f"autopar: a search worker could not start ({e}); the search "
                              f"goes on with {i}.", RuntimeWarning, stacklevel=2)
                reader.close()
                writer.close()
                break
            finally:
                self._out = self._in = None
            writer.close()  # (the worker holds the only writing end: its death ends the pipe)
            self._conns[i + 1] = reader
            self.procs.append(p)
        self._heard = [time.monotonic()] * len(self.procs)

    def claim(self, b: int) -> None:
        """The search is about to trace size ``b`` itself: no worker starts it."""
        if b in self.sizes:
            with self._claims.get_lock():
                i = self.sizes.index(b)
                if self._claims[i] == 0:
                    self._claims[i] = -1

    def take(self, key: LayerKey) -> tuple[Any, float] | None:
        """A worker's ``(LayerCosts, seconds)`` for ``key``, waiting for it while a live worker
        has its size and will solve it; ``None`` when the search must solve it itself."""
        while key not in self._ready:
            if not self._pending(key[1]) or key not in self.keys.get(key[1], ()):
                return None
            facts = self._facts.get(key[1])
            if key[2] and self.skip_unsplit and facts and not facts[0].shards_sequence:
                return None  # (not solved there: nothing for sequence parallelism to split)
            self._receive()
        self.delivered += 1
        return self._ready.pop(key)

    def take_facts(self, b: int) -> tuple[TraceFacts, float] | None:
        """A worker's ``(TraceFacts, trace seconds)`` for size ``b``, as :meth:`take`."""
        while b not in self._facts:
            if not self._pending(b):
                return None
            self._receive()
        return self._facts[b]

    def facts_received(self) -> dict[int, tuple[TraceFacts, float]]:
        """The ``(TraceFacts, trace seconds)`` received so far, by size (every size whose
        costs the search took among them: a worker sends a size's facts first)."""
        return dict(self._facts)

    def close(self) -> None:
        """Stop the workers (those done have exited) and close their pipes."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def next_size(self, worker: int) -> int | None:
        """(In worker ``worker``.) Claim the largest free size; ``None`` when none is left."""
        with self._claims.get_lock():
            for i in reversed(range(len(self.sizes))):
                if self._claims[i] == 0:
                    self._claims[i] = worker
                    return self.sizes[i]
        return None

    def send(self, *message: Any) -> None:
        """(In a worker.) Pass ``message`` (the worker's number first) to the search, through
        the worker's sending thread (:func:`sending`)."""
        self._outbox.put(message)

    def _pending(self, b: int) -> bool:
        """Whether a live worker has size ``b`` and has not given it up."""
        if b not in self.sizes or b in self._failed or b in self._done:
            return False
        owner = self._claims[self.sizes.index(b)]
        if owner <= 0:
            return False
        # (a worker that stopped has its pipe read to the end first: _receive)
        return owner in self._conns

    def _receive(self) -> None:
        """Read what the workers sent within a second; a pipe at its end (its worker
        stopped, between messages or in one) gives that worker's open sizes to the search."""
        ready = mpc.wait(list(self._conns.values()), timeout=1.0)
        if not ready:
            now = time.monotonic()
            for i, p in enumerate(self.procs):
                if i + 1 in self._conns and now - self._heard[i] > self._silence_s:
                    p.terminate()
                    self._give_up(i + 1, f"no word from worker {i + 1} in "
                                         f"{self._silence_s:.0f} s; stopped")
            return
        for worker, conn in list(self._conns.items()):
            if conn in ready:
                self._read(worker, conn)

    def _read(self, worker: int, conn: Any) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # (ended: after its last message, or in the middle of one)
            conn.close()
            del self._conns[worker]
            p = self.procs[worker - 1]
            p.join(timeout=5)
            self._give_up(worker, f"worker {worker} stopped (exit code {p.exitcode})")
            return
        worker, kind, what, *rest = message
        self._heard[worker - 1] = time.monotonic()
        if kind == "costs":
            self._ready[what] = (rest[0], rest[1])
        elif kind == "facts":
            self._facts[what] = (rest[0], rest[1])
        elif kind == "done":
            self._done.add(what)
        elif kind == "failed":
            self._give_up(worker, rest[0], what)

    def _give_up(self, worker: int, why: str, only: int | None = None) -> None:
        """The sizes of ``worker`` (or size ``only``) not finished are the search's now."""
        lost = [b for i, b in enumerate(self.sizes) if self._claims[i] == worker
                and b not in self._done and b not in self._failed and only in (None, b)]
        for b in lost:
            self._failed[b] = why
        if lost:
            warnings.warn(f"autopar: a search worker did not solve microbatch size(s) "
                          f"{', '.join(map(str, lost))} ({why}); the search solves them itself.",
                          RuntimeWarning, stacklevel=2)


def _work(solver: Any, ahead: AheadSolver, me: int, skip_unsplit: bool) -> None:
    """A worker's loop: claim a size, trace it, solve its keys, send each result."""
    import torch

    # a kernel run here (a real model's trace runs some) must not start an OpenMP team: the
    # parent's pool of threads is not in the fork, and libgomp would wait for it forever
    torch.set_num_threads(1)
    solver.ahead = None  # (this copy computes; it waits for no one)
    # the reading ends are the search's: held here too, a search that died would leave this
    # worker writing to a pipe nobody reads, forever
    for conn in [ahead._in, *ahead._conns.values()]:
        conn.close()
    ahead._outbox = queue.Queue()
    sender = threading.Thread(target=sending, args=(ahead._out, ahead._outbox), daemon=True)
    sender.start()
    try:
        _solve_sizes(solver, ahead, me, skip_unsplit)
    finally:
        ahead._outbox.put(None)
        sender.join()


def sending(conn: Any, outbox: "queue.Queue") -> None:
    """(A worker's thread.) Write each message of ``outbox`` to the planner's pipe until
    ``None``, so that the worker computes on while the planner is busy (a message is written
    whole only once the planner reads it: a pipe holds 64 KiB on Linux); ``bytes`` are written
    as they are (a message pickled by the worker, ``conn.recv()`` reads it as sent). A message
    that cannot be written (one that does not pickle, a planner that has gone) ends the worker
    at once, its traceback on its stderr: the planner then reads the pipe's end and does the
    worker's work itself."""
    try:
        while (message := outbox.get()) is not None:
            _write_message(conn, message)
        conn.close()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _write_message(conn: Any, message: tuple | bytes) -> None:
    """Write one message to the planner (a function of its own: a test stops a worker in the
    middle of one)."""
    if isinstance(message, bytes):
        conn.send_bytes(message)
    else:
        conn.send(message)


def _solve_sizes(solver: Any, ahead: AheadSolver, me: int, skip_unsplit: bool) -> None:
    """Claim sizes, trace each, solve its keys, send each result."""
    while (b := ahead.next_size(me)) is not None:
        try:
            t0 = time.perf_counter()
            facts = solver.facts(b, flops=True)
            ahead.send(me, "facts", b, facts, time.perf_counter() - t0)
            for key in ahead.keys[b]:
                if key[2] and skip_unsplit and not facts.shards_sequence:
                    continue
                t0 = time.perf_counter()
                costs = solver.costs(*key)
                ahead.send(me, "costs", key, costs, time.perf_counter() - t0)
            ahead.send(me, "done", b)
        except Exception as e:  # (told to the search, which solves the size itself)
            text = str(e).strip().splitlines()
            ahead.send(me, "failed", b, f"{type(e).__name__}: {text[0] if text else ''}")
            return

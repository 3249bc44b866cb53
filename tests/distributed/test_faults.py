"""A rank that dies or hangs mid-step: every other rank stops with RankFailureError, in time.

Four ranks are started as plain processes (not torchrun: its agent would kill the others as soon
as one exits, hiding whether they stop on their own). In its second training step, rank 2 dies
(exits) or hangs (sleeps) at its second collective; see ``fault_worker.py``. The model (MLP,
dp=2 x tp=2, sharded hard by the slow-compute topology) links every rank to rank 2 in a step,
directly or through a rank that waits on it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fault_worker.py")
TIMEOUT_S = 5.0
VICTIM = 2
DIE_EXIT = 17  # fault_worker.DIE_EXIT
# Startup, planning and the first step take ~10 s on 4 processes sharing 2 cores; a run is cut
# at this many seconds.
JOB_LIMIT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, tmp: Path, check: str = "mlp:dp=2,tp=2") -> dict[int, dict]:
    """Start the 4 ranks; return each rank's exit code, seconds from the fault to its exit, and
    log. The hung victim is killed once the others have exited."""
    port, procs, logs = _free_port(), [], []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4",
                   LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        logs.append(tmp / f"{mode}-rank{rank}.log")
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(VICTIM), str(TIMEOUT_S), check], env=env,
            stdout=logs[-1].open("w"), stderr=subprocess.STDOUT))
    ended: dict[int, float] = {}
    start = time.time()
    others = set(range(4)) - {VICTIM}
    while time.time() - start < JOB_LIMIT_S and not others <= set(ended):
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    texts = [log.read_text() for log in logs]
    fault = [float(line.split()[1]) for line in texts[VICTIM].splitlines() if line.startswith("FAULT ")]
    assert fault, f"rank {VICTIM} never reached its fault:\n{texts[VICTIM][-3000:]}"
    return {rank: {"code": procs[rank].returncode, "log": texts[rank],
                   "after_s": ended[rank] - fault[0] if rank in ended else None}
            for rank in range(4)}


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_failed_rank_stops_every_other_rank_within_the_timeout(mode, tmp_path):
    ranks = _run(mode, tmp_path)
    if mode == "die":
        assert ranks[VICTIM]["code"] == DIE_EXIT
    for rank in set(range(4)) - {VICTIM}:
        r = ranks[rank]
        assert r["after_s"] is not None, f"rank {rank} still running {JOB_LIMIT_S} s in:\n{r['log'][-3000:]}"
        assert r["code"] != 0, f"rank {rank} exited 0 after rank {VICTIM} failed:\n{r['log'][-3000:]}"
        assert "autopar.errors.RankFailureError" in r["log"], r["log"][-3000:]
        assert f"rank {rank} of 4" in r["log"] and f"timeout_s={TIMEOUT_S:g}" in r["log"]
        # A dead rank closes its sockets: its peers fail at once, and the ranks waiting on
        # them right after. A hung rank answers nothing: its peers wait out the timeout, then
        # fail, and so do the ranks waiting on them. The slack (10 s) covers interpreter
        # shutdown on 2 shared cores; measured: die <= 3.3 s, hang <= 7.9 s.
        bound = 10.0 if mode == "die" else TIMEOUT_S + 10.0
        assert r["after_s"] <= bound, (rank, r["after_s"])
        # the step in which rank 2 failed did not complete anywhere
        assert f"rank {rank} step 1 loss" not in r["log"]

"""Shared multi-process runs: one torchrun job per world size runs every check of that size."""

from __future__ import annotations

import json
import atexit
import os
import socket
import subprocess
import sys
import shutil
import tempfile
from pathlib import Path

import pytest

# plans cached by parallelize (in the jobs started here, which inherit the environment) go to
# a directory of this test run, not the user's cache
os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-test-cache-")
atexit.register(shutil.rmtree, os.environ["AUTOPAR_CACHE_DIR"], ignore_errors=True)

WORKER = Path(__file__).with_name("worker.py")
sys.path.insert(0, str(WORKER.parents[1]))  # tests/models.py, as in the workers


def run_worker(nproc: int, checks: list[str], tmp: Path, timeout: int = 900) -> dict:
    """Run ``checks`` in one ``torchrun --nproc_per_node=nproc`` job; return rank 0's results."""
    out = tmp / f"results_{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(WORKER), str(out), *checks]
    # (a rank that dies of a native fault prints its Python stack: faulthandler)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"worker failed (exit {proc.returncode}):\n{_native_lines(proc.stderr)}"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _native_lines(stderr: str) -> str:
    """The lines of ``stderr`` that say what a native fault was (glibc, C++ terminate,
    faulthandler's header), which the tail of a long log can cut off."""
    keys = ("malloc", "free()", "corrupted", "terminate called", "what():", "Fatal Python error")
    lines = [line for line in stderr.splitlines() if any(k in line for k in keys)]
    return "native fault lines:\n" + "\n".join(lines[:20]) + "\n" if lines else ""


class CheckServer:
    """A ``torchrun --nproc_per_node=nproc worker.py --serve`` job that runs the checks sent to
    it one at a time (so a test can choose them as it goes, as hypothesis does)."""

    def __init__(self, nproc: int, workdir: Path, start_timeout_s: float = 300.0) -> None:
        self.nproc, self.log = nproc, workdir / f"serve_{nproc}.log"
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(start_timeout_s)
        port = listener.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(WORKER), "--serve", str(port), str(workdir)]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1",
                                              PYTHONFAULTHANDLER="1"))
        try:
            self.conn, _ = listener.accept()
        except TimeoutError:
            self.close()
            raise AssertionError(f"the {nproc}-process job did not connect in {start_timeout_s} s:"
                                 f"\n{self.log.read_text()[-6000:]}") from None
        finally:
            listener.close()
        self.lines = self.conn.makefile("r")

    def run(self, check: str) -> dict:
        """Run ``check`` on every rank of the job; rank 0's record."""
        self.conn.sendall((check + "\n").encode())
        line = self.lines.readline()
        if not line:
            raise AssertionError(f"the {self.nproc}-process job ended during {check!r}:\n"
                                 f"{self.log.read_text()[-6000:]}")
        return json.loads(line)

    def close(self) -> None:
        """End the job (an empty line), or kill it if it does not end."""
        if getattr(self, "conn", None) is not None:
            try:
                self.conn.sendall(b"\n")
            except OSError:
                pass  # the job is gone already; wait() below collects it
            self.conn.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distributed")


# Tolerances of a check against one process (records from grads.compare_on_every_rank, per rank
# and per parameter, each gradient relative to that parameter's own largest one-process value).
# fp32: the parallel program sums the same products in another order (shards, microbatches,
# tied-weight parts): a few ulp (2**-24 = 6e-8) per sum, a few sums deep; 1e-5 leaves ~15x
# margin over the largest error seen (6.6e-7, gpt tp=2 with sequence parallelism).
FP32_TOL = (1e-5, 1e-5)
# bf16 autocast against a one-process bf16 autocast run: 8 significant bits (unit roundoff
# 2**-8 = 0.39%); sharding moves where partial sums are rounded to bf16, a few roundings deep:
# 1% on the loss, 3% per parameter (seen: 0.006% and 0.56%).
BF16_TOL = (1e-2, 3e-2)


def assert_matches_one_process(record: dict, tolerance: tuple[float, float] = FP32_TOL,
                               what: object = "", autograd: bool = True) -> None:
    """The loss on every rank and every rank's gradient shards, per parameter, within
    ``tolerance`` = (loss, gradient) of one process; every held parameter got a gradient.
    ``autograd``: also the same plan through forward + ``loss.backward()`` (flat plans)."""
    assert "error" not in record, record.get("error", "") + "\n" + record.get("trace", "")
    loss_tol, grad_tol = tolerance
    prefixes = ("", "autograd_") if autograd and "autograd_grad_rel" in record else ("",)
    for prefix in prefixes:
        assert record[f"{prefix}loss_err"] <= loss_tol, (what, prefix, record[f"{prefix}loss_err"])
        assert record[f"{prefix}grad_rel"] <= grad_tol, (what, prefix, record[f"{prefix}grad_rel"],
                                                         record[f"{prefix}grad_worst"])
        assert not record[f"{prefix}grad_missing"], (what, prefix, record[f"{prefix}grad_missing"])
        assert record[f"{prefix}grad_checked"] == record["grad_expected"], (what, prefix, record)

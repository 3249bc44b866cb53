"""Shared multi-process runs: one torchrun job per world size runs every check of that size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")


def run_worker(nproc: int, checks: list[str], tmp: Path, timeout: int = 900) -> dict:
    """Run ``checks`` in one ``torchrun --nproc_per_node=nproc`` job; return rank 0's results."""
    out = tmp / f"results_{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(WORKER), str(out), *checks]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distributed")

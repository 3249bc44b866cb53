"""The README's first command, ``make demo`` (``python -m autopar demo``), run as a test: on 2
processes (the README's runs 4) for 3 steps, its losses equal one process's on every rank (the
demo itself checks them and exits non-zero when they differ)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autopar.demo import LOSS_RTOL, check_losses


def test_demo_losses_equal_one_process():
    proc = subprocess.run([sys.executable, "-m", "autopar", "demo", "--nproc", "2", "--steps", "3"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "on every rank" in proc.stdout, proc.stdout[-3000:]
    table = [line.split() for line in proc.stdout.split("single process")[-1].splitlines()]
    rows = [(int(r[0]), float(r[1]), float(r[2])) for r in table if len(r) == 4 and r[0].isdigit()]
    assert [r[0] for r in rows] == [0, 1, 2], proc.stdout[-3000:]
    assert all(abs(a - b) <= LOSS_RTOL * max(1.0, abs(b)) for _, a, b in rows), rows


def test_demo_check_fails_on_a_loss_that_differs():
    check_losses([(0, 5.0, 5.0), (1, 4.9, 4.9)], rank=0)
    with pytest.raises(SystemExit, match="rank 1: losses differ.*steps \\[1\\]"):
        check_losses([(0, 5.0, 5.0), (1, 4.9, 4.9 * (1 + 10 * LOSS_RTOL))], rank=1)

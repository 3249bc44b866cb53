"""Slower multi-process checks, outside the default run (``pytest -m slow``)."""

from __future__ import annotations

import pytest

from conftest import run_worker

pytestmark = pytest.mark.slow


def test_compiled_program_matches_single_process(results_dir):
    r = run_worker(2, ["gpt:tp=2,compile=1"], results_dir)["gpt:tp=2,compile=1"]
    assert "error" not in r, r.get("trace")
    # inductor may fuse and reorder fp32 arithmetic: same bound as the eager program
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * max(1.0, abs(r["ref_loss"]))
    assert r["grad_abs_err"] <= 1e-5 * max(1.0, r["grad_scale"])

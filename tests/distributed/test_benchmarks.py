"""The runtime and start-up benchmarks run (at tiny sizes: figures are the benchmarks' job,
not the tests'), and what they report is consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _check_runtime(out: Path, compiled: bool) -> None:
    results = json.loads(out.read_text())["results"]
    modes = [False, True] if compiled else [False]
    assert [(r["comparison"], r["compiled"]) for r in results] == [
        (name, c) for c in modes for name in ("tp=2", "dp=2", "pp=2 1f1b")]
    for r in results:
        assert r["autopar_s"] > 0 and r["torch_s"] > 0 and r["ratio"] > 0
        assert len(r["times"]["autopar"]) == len(r["times"]["torch"]) == 2
        for rank in r["ranks"]:  # autopar's measured collectives are the plan's, on every rank
            planned = {k: v for k, v in rank["plan"]["bytes"].items() if v}
            assert rank["autopar"]["bytes"] == planned, (r["comparison"], rank)
            assert sum(rank["torch"]["bytes"].values()) > 0  # the hand-written one communicates


@pytest.mark.slow  # 23 s; the collectives counted equal the plan's in test_equivalence too
def test_runtime_benchmark_runs_at_tiny_size(tmp_path):
    out = tmp_path / "runtime.json"
    text = _run("runtime_vs_torch.py", "--size", "tiny", "--repeats", "2", "--warmup", "1",
                "--no-compile", "--json", str(out))
    assert "autopar ms" in text and "torch ms" in text
    _check_runtime(out, compiled=False)


@pytest.mark.slow
def test_runtime_benchmark_runs_compiled_at_tiny_size(tmp_path):
    out = tmp_path / "runtime.json"
    _run("runtime_vs_torch.py", "--size", "tiny", "--repeats", "2", "--warmup", "1",
         "--json", str(out), timeout=1800)
    _check_runtime(out, compiled=True)


@pytest.mark.slow  # 25 s; the cache itself is tested in tests/unit/test_plan_cache.py
def test_startup_benchmark_reads_the_plan_from_the_cache_the_second_time():
    text = _run("startup.py", "--nproc", "2", "--no-compile")
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith(("first", "second"))}
    assert rows["first"][1] == "miss" and rows["second"][1] == "hit", text
    # the second launch skips the search: its planning takes a fraction of the first's
    assert float(rows["second"][3]) < float(rows["first"][3]), text


@pytest.mark.slow
def test_fsdp2_benchmark_runs_at_tiny_size(tmp_path):
    """benchmarks/fsdp2.py: autopar's ZeRO-3 next to fully_shard; autopar moves exactly the
    plan's bytes (its per-layer flat gathers and bucketed reduce-scatters included)."""
    out = tmp_path / "fsdp2.json"
    _run("fsdp2.py", "--procs", "2", "--size", "tiny", "--repeats", "2", "--warmup", "1",
         "--no-compile", "--json", str(out))
    (r,) = json.loads((tmp_path / "fsdp2_2.json").read_text())["results"]
    assert r["comparison"] == "dp=2 ZeRO-3" and r["autopar_s"] > 0 and r["torch_s"] > 0
    for rank in r["ranks"]:
        planned = {k: v for k, v in rank["plan"]["bytes"].items() if v}
        assert rank["autopar"]["bytes"] == planned, rank
        assert planned.get("all_gather"), planned  # (ZeRO-3 gathers its parameters)
        assert sum(rank["torch"]["bytes"].values()) > 0


@pytest.mark.slow  # 100 s: two compilations of each model; on a GPU the same script checks it
def test_gpu_check_runs_on_the_cpu_at_tiny_size(tmp_path):
    out = tmp_path / "gpu_check.json"
    _run("gpu_check.py", "--cpu", "--json", str(out))
    res = json.loads(out.read_text())
    rows = res["equivalence"]
    assert [(r["precision"], r["compiled"]) for r in rows] == [
        (p, c) for p in ("fp32", "bf16") for c in (False, True)]
    assert all(r["ok"] and "error" not in r for r in rows), rows
    assert {r["dtype"] for r in res["kernels"]} == {"bf16", "fp32"}
    # the compute calibration: every operator of the model timed (none refused), both kinds
    matmuls, others, fitted = res["calibration"]
    assert matmuls["kernels"] == "matmuls" and matmuls["measured_ms"] > 0, res["calibration"]
    assert others["kernels"] == "other ops" and others["measured_ms"] > 0, res["calibration"]
    assert fitted["not_timed"] == [] and 0 < fitted["matmul_efficiency"] <= 1, fitted
    autopar_row, torch_row = res["step"]
    assert autopar_row["params"] == torch_row["params"] and autopar_row["predicted_s"] > 0
    assert autopar_row["predicted_s_calibrated"] > 0
    # context parallelism's blocks, CPU's kernel: 2 and 4 ranks, both forms, layouts and masks
    cp = res["cp_kernels"]
    assert sum("ok" in r for r in cp) == 16 and all(r["ok"] for r in cp if "ok" in r), cp
    assert [r["case"] for r in cp if "fwd_ms" in r] == [
        "whole causal kernel", "cp=4 rank 0, balanced", "cp=4 rank 0, contiguous",
        "cp=4 rank 3, contiguous"]


@pytest.mark.slow  # 40 s
def test_context_parallel_benchmark_runs_at_tiny_size(tmp_path):
    _run("context_parallel.py", "--size", "tiny", "--procs", "2", "--repeats", "2", "--no-compile",
         "--json", str(tmp_path / "cp.json"))
    res = json.loads((tmp_path / "cp_2.json").read_text())
    (row,) = res["autopar"]
    assert row["degrees"]["cp"] == 2 and row["bytes"] == row["plan_bytes"]
    # PyTorch's runs here, and its loss is not one process's: the model's positions are local
    assert res["torch"]["torch"] == "ran" and res["torch"]["loss_rel_err"] > 1e-4


@pytest.mark.slow  # 30 s
def test_moe_ep_benchmark_runs_at_tiny_size(tmp_path):
    """benchmarks/moe_ep.py: autopar's ep=2 next to expert parallelism written by hand with
    all_to_all_single. autopar sends the plan's all-to-alls (the bytes, which follow the
    routing, equal the plan's summed over the ranks); the hand-written step's loss and
    gradients are one process's on the same global batch. Tolerance: fp32 with the same math,
    summed in another order (each rank's mean loss averaged over the ranks, the experts' rows
    grouped by rank, the dense gradients all-reduced), a few ulps of the loss, 1e-6 relative;
    a routing decided differently would change the loss by far more."""
    _run("moe_ep.py", "--procs", "2", "--size", "tiny", "--repeats", "2", "--warmup", "1",
         "--json", str(tmp_path / "moe.json"))
    (r,) = json.loads((tmp_path / "moe_2.json").read_text())["results"]
    assert r["autopar_s"] > 0 and r["hand_s"] > 0 and r["ratio"] > 0
    assert len(r["times"]["autopar"]) == len(r["times"]["hand"]) == 2
    assert r["degrees"]["ep"] == 2 and r["degrees"]["dp"] == 2
    for rank in r["ranks"]:
        a2a = rank["autopar"]["counts"].get("all_to_all", 0)
        assert a2a > 0 and a2a == rank["plan"]["counts"]["all_to_all"], rank
        assert rank["hand"]["counts"].get("all_to_all", 0) > 0, rank
    total = lambda who: sum(rank[who]["bytes"]["all_to_all"] for rank in r["ranks"])  # noqa: E731
    assert total("autopar") == total("plan")
    assert r["hand_loss_rel_err"] <= 1e-6 and r["hand_grad_rel_err"] <= 1e-5, r
    assert r["autopar_loss_rel_err"] <= 1e-6, r
    # the skew is measured on the rows each rank received: one process's routing of the batch
    assert r["routing_as_one_process"] and r["skew"] >= 1 and min(r["skew_per_layer"]) >= 1

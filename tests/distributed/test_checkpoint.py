"""Checkpoints: full state dicts equal the single-device model's; a sharded DCP checkpoint saved
under one plan (with AdamW's state) restores exactly under others and training resumes with the
losses of the uninterrupted run. See ``checkpoint_check.py`` for what each check does."""

from __future__ import annotations

import pytest

from conftest import run_worker

# Saved under tp=2; loaded under dp=2 and under pp=2 (whose ranks hold different parameters;
# the GPT ties its embedding and LM head, which land on different pipeline ranks). The
# slow-compute costs make tp=2 shard every layer (cpu-gloo's would replicate them all),
# the fused QKV projection strided (its rows of q, k and v), which DCP cannot describe.
GPT = "ckpt:gpt,layers=2,batch=8,topo=slow-compute|tp=2|dp=2|pp=2,microbatch_size=2,schedule=1f1b"
# slow (same costs): Llama (rotary buffers) saved under pp=2, loaded under tp=2 and under dp=2 with ZeRO-1;
# 4 processes: dp=2 x tp=2 to pp=2 x tp=2 and to interleaved pp=2 x dp=2 with ZeRO-1
LLAMA = "ckpt:llama,layers=2,batch=8,topo=slow-compute|pp=2,microbatch_size=2,schedule=1f1b|tp=2|dp=2,zero=1"
FOUR = ("ckpt:gpt,layers=4,batch=8,topo=slow-compute|dp=2,tp=2|pp=2,tp=2,microbatch_size=2,schedule=1f1b|"
        "pp=2,dp=2,zero=1,microbatch_size=2,schedule=interleaved-1f1b,virtual_stages=2")


def check_record(r: dict) -> None:
    """The assertions every checkpoint check must pass."""
    assert "error" not in r, r.get("error", "") + "\n" + r.get("trace", "")
    # the full state dict is copies of the parameters: bit-equal to the single-device model's
    assert r["keys_match"] and r["full_vs_single_err"] == 0.0, r
    assert r["plans"], r
    for plan, p in r["plans"].items():
        assert p["extra"] == {"step": 2}, (plan, p)
        # loading moves bytes, it computes nothing: parameters and AdamW states bit-equal
        assert p["state_err"] == 0.0 and p["full_load_err"] == 0.0, (plan, p)
        assert p["opt_keys_match"] and p["opt_err"] == 0.0, (plan, p)
        # the resumed run's losses are the uninterrupted run's; the plans reduce in other orders
        # (fp32, a few ulp per sum): 1e-5 relative bounds it with margin (seen: <= 1e-7). The
        # second loss follows an AdamW step from the loaded moments: wrong optimizer state
        # would change it at the 1e-2 level.
        for got, want in zip(p["losses"], r["losses_after"], strict=True):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (plan, p["losses"], r["losses_after"])


def test_checkpoint_saved_under_one_plan_resumes_under_others(results_dir):
    out = results_dir / "checkpoint"
    out.mkdir(exist_ok=True)
    r = run_worker(2, [GPT], out)[GPT]
    check_record(r)
    assert set(r["plans"]) == {"dp=2", "pp=2|microbatch_size=2|schedule=1f1b"}
    # what was saved was sharded, strided shards included
    assert {"S(0)", "S(1)", "SS(0,3)"} <= set(r["placements"]), r["placements"]
    e = r["errors"]
    assert e["no_optimizer_state"].startswith("PlanError") and "no optimizer state" in e["no_optimizer_state"]
    assert e["other_model"].startswith("PlanError") and "blocks.2" in e["other_model"] \
        and "another model" in e["other_model"], e["other_model"]
    assert e["unexpected_key"].startswith("RuntimeError") and "extra.weight" in e["unexpected_key"]
    assert e["missing_key"].startswith("RuntimeError") and "missing keys ['wte.weight']" in e["missing_key"]
    assert "unexpected_keys=['extra.weight']" in e["non_strict"], e["non_strict"]
    assert e["wrong_shape"].startswith("RuntimeError") and "(1, 64)" in e["wrong_shape"], e["wrong_shape"]
    assert e["dtensor"].startswith("TypeError") and "load_checkpoint" in e["dtensor"], e["dtensor"]


# slow: saved under ZeRO-3 (dp=2), loaded under tp=2, a pipeline, plain dp and ZeRO-1; saved
# under tp=2 and under ZeRO-1, loaded under ZeRO-3
ZERO3 = ["ckpt:gpt,layers=2,batch=8,topo=slow-compute|dp=2,zero=3|tp=2|pp=2,microbatch_size=2,"
         "schedule=1f1b|dp=2,zero=0|dp=2,zero=1",
         "ckpt:gpt,layers=2,batch=8,topo=slow-compute|tp=2|dp=2,zero=3",
         "ckpt:gpt,layers=2,batch=8,topo=slow-compute|dp=2,zero=1|dp=2,zero=3"]


@pytest.mark.slow
def test_checkpoints_across_more_plans(results_dir):
    out = results_dir / "checkpoint-slow"
    out.mkdir(exist_ok=True)
    check_record(run_worker(2, [LLAMA], out)[LLAMA])
    for check, r in run_worker(2, ZERO3, out).items():
        check_record(r)
        assert len(r["plans"]) == check.count("|") - 1, (check, r["plans"])
    check_record(run_worker(4, [FOUR], out)[FOUR])

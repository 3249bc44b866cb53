"""Pipeline parallelism against one process: every schedule on pp=2, and pp=2 x tp=2, pp=2 x dp=2
(also with full recomputation and ZeRO-1).

The GPT models tie their embedding and LM head, which land on different stages, so these checks
also prove the tied gradient is the sum of both stages' parts. One torchrun job per world size
runs all checks of that size (see ``worker.py``).
"""

from __future__ import annotations

import pytest

from conftest import BF16_TOL, FP32_TOL, assert_matches_one_process, run_worker

MODEL = "gpt:layers=2,batch=8,microbatch_size=2"
SCHEDULES = {  # schedule -> virtual stages per rank
    "gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2,
}
# Hugging Face models too: GPT-2 (tied, lifted constants in attention), Llama (rotary buffers,
# recomputed in every stage rather than sent)
HF = [f"{kind}:layers=2,batch=8,microbatch_size=2,pp=2,schedule=1f1b" for kind in ("gpt2", "llama")]
# autopar.profile_step under torch.profiler: a pipelined plan and a flat one (tp=2)
PROFILES = [f"prof:{MODEL},pp=2,schedule=1f1b", "prof:gpt:tp=2"]
# bf16 autocast in pipeline stages, against a one-process autocast run
BF16 = {2: f"{MODEL},pp=2,schedule=1f1b,mixed_precision=bf16",
        4: f"{MODEL},pp=2,dp=2,schedule=interleaved-1f1b,virtual_stages=2,mixed_precision=bf16"}
# compiled with inductor: each stage's forward and backward graphs (next to the eager 1f1b run)
COMPILED = f"{MODEL},pp=2,schedule=1f1b,virtual_stages=1,compile=1"
CHECKS = {
    2: [f"{MODEL},pp=2,schedule={s},virtual_stages={v}" for s, v in SCHEDULES.items()] + HF + PROFILES
    + [BF16[2], COMPILED],
    4: [f"{MODEL},pp=2,tp=2,schedule=1f1b", f"{MODEL},pp=2,dp=2,schedule=1f1b",
        # part 4's recomputation and ZeRO-1 inside pipeline stages (the tied weight is sharded
        # over dp on both of its stages)
        f"{MODEL},pp=2,dp=2,schedule=1f1b,zero=1,recompute=full",
        # 4 and 8 microbatches of a model wide enough that its stages split the batch over dp
        # at both: the dp gradient reductions of a step stay as many, without ZeRO and with
        *(f"gpt:layers=2,dim=128,seq=32,batch={b},microbatch_size=4,pp=2,dp=2,zero={z},schedule=1f1b,topo=a100-dgx"
          for z in (0, 1) for b in (16, 32)), BF16[4],
        # zero-bubble likewise: its weight steps sum into the same buckets (ZeRO-1 here)
        *(f"gpt:layers=2,dim=128,seq=32,batch={b},microbatch_size=4,pp=2,dp=2,zero=1,"
          f"schedule=zero-bubble,virtual_stages=2,topo=a100-dgx" for b in (16, 32)),
        # Llama with tp inside the stages (the test costs shard nearly every op): its loss
        # split over the tokens (exact only as a sum over the total weight), and no forward
        # collective copied into a stage's backward graph (counted against the plan)
        "llama:layers=2,batch=4,microbatch_size=1,pp=2,tp=2,schedule=1f1b"],
}
DP_M4, DP_M8, ZERO_M4, ZERO_M8 = CHECKS[4][3:7]
ZB_M4, ZB_M8 = CHECKS[4][8:10]
# ZeRO-3 in pipeline stages, 1F1B and interleaved (where a rank's other stage holds no gathered
# copy), each with the peak memory of a step measured against the plan's. (The interleaved one
# once measured 4.8% over its prediction on one rank, at an earlier commit; on 2026-11-26 it was
# +0.95% / +1.94% per pipeline rank in 8 runs, 3 of them beside two busy processes.)
ZERO3 = [f"gpt:layers=2,dim=128,seq=32,batch=16,microbatch_size=4,pp=2,dp=2,zero=3,schedule={s},"
         f"virtual_stages={v},topo=a100-dgx,memory=1" for s, v in (("1f1b", 1), ("interleaved-1f1b", 2))]
# and interleaved in bf16 autocast: the matmul weights cast on the shard, gathered in bf16
ZERO3_BF16 = ZERO3[1] + ",mixed_precision=bf16"
CHECKS[4] += [*ZERO3, ZERO3_BF16]


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def world(request, results_dir):
    out = results_dir / "pipeline"
    out.mkdir(exist_ok=True)
    return request.param, run_worker(request.param, CHECKS[request.param], out)


def _ok(record: dict) -> dict:
    assert "error" not in record, record.get("error", "") + "\n" + record.get("trace", "")
    return record


def _pipelines(n: int) -> list[str]:
    return [c for c in CHECKS[n] if not c.startswith("prof:")]


def test_loss_and_every_gradient_match_one_process(world):
    n, results = world
    for check in _pipelines(n):
        r = _ok(results[check])
        # fp32; the pipeline sums microbatch gradients (m = 4) and the tied weight's two stage
        # parts in another order than one process (conftest.FP32_TOL); each rank checks its
        # stages'. bf16 autocast against one process's autocast run (conftest.BF16_TOL)
        assert_matches_one_process(r, BF16_TOL if "bf16" in check else FP32_TOL, check)
        if "bf16" in check:  # autocast per stage: bf16 matmuls, fp32 parameters and gradients
            assert r["techniques"]["mixed_precision"] == "bf16-autocast", (check, r["techniques"])
            assert r["stage_bf16_ops"] > 0 and r["grad_dtypes"] == ["torch.float32"], (check, r)
        # a second step on the same batch gives the same loss (state is reset between steps)
        assert abs(r["loss_again"] - r["loss"]) <= 1e-6 * max(1.0, abs(r["loss"])), (check, r)
        # every parameter of the model is held by some rank, under its own name
        assert r["params_covered"] == r["ref_n_params"], (check, r)


def test_plan_is_the_configured_pipeline(world):
    n, results = world
    for check in _pipelines(n):
        r = _ok(results[check])
        assert r["degrees"]["pp"] == 2 and r["mesh_shape"][0] == 2, (check, r)
        schedule = check.split("schedule=")[1].split(",")[0]
        batch, size = (int(check.split(f"{k}=")[1].split(",")[0]) for k in ("batch", "microbatch_size"))
        assert r["schedule"] == schedule and r["microbatches"] == batch // size, (check, r)
        v = int(check.split("virtual_stages=")[1].split(",")[0]) if "virtual_stages=" in check else 1
        assert r["virtual_stages"] == v
        stages = r["stage_of_unit"]
        assert stages == sorted(stages) and set(stages) == set(range(2 * v)), (check, stages)
        assert r["units"][0] == "pre" and r["units"][-1] == "post"
    if n == 4:
        assert results[CHECKS[4][0]]["degrees"]["tp"] == 2
        assert results[CHECKS[4][1]]["degrees"]["dp"] == 2


def test_runtime_collectives_and_transfers_equal_plan(world):
    n, results = world
    for check in _pipelines(n):
        r = _ok(results[check])
        assert r["runtime_counts"] == r["plan_counts"], (check, r["runtime_counts"], r["plan_counts"])
        assert r["runtime_bytes"] == r["plan_bytes"], (check, r["runtime_bytes"], r["plan_bytes"])
        assert r["count_mismatch_ranks"] == 0, (check, "some rank's counts or bytes differ from its plan")
        # rank 0 sends each microbatch's activations and receives their gradients (and more
        # with interleaved stages): as many sends as receives, at least one per microbatch
        assert r["plan_counts"]["send"] == r["plan_counts"]["recv"] >= r["microbatches"]


def test_profile_step_sets_measured_against_predicted_times_and_comm(world):
    n, results = world
    if n != 2:
        pytest.skip("profiled on 2 processes")
    for check in PROFILES:
        r = _ok(results[check])
        names = [row[0] for row in r["times"]]
        if r["pipelined"]:  # every stage of every rank, forward and backward per microbatch
            assert names == ["step"] + [f"stage {j} {ph} / microbatch" for j in (0, 1)
                                        for ph in ("forward", "backward")], names
            # (rank 0's profile: its stage)
            assert {"autopar step", "autopar stage 0 forward", "autopar stage 0 backward"} \
                <= set(r["profiler_ranges"]), r["profiler_ranges"]
        else:
            assert names == ["step", "forward", "backward"], names
            assert "autopar step" in r["profiler_ranges"], r["profiler_ranges"]
        # every figure measured and predicted (timings are not compared: CPU noise)
        assert all(p > 0 and m > 0 for _, p, m in r["times"]), r["table"]
        # the collectives of a step: this rank's, as the plan says
        assert r["comm"] and all(pc == mc and pb == mb for pc, mc, pb, mb in r["comm"].values()), r["table"]
        assert r["grads_cleared"] and "predicted ms" in r["table"]


def test_pipeline_reduces_data_parallel_gradients_once_a_step(world):
    # pp=2 x dp=2 at 4 and at 8 microbatches: each stage sums its gradients over the step's
    # microbatches and reduces them over dp once, after the schedule, so the step's all-reduces
    # (counted at run time on every rank, equal to the plan's by the test above) do not grow
    # with the microbatches; sends and receives do (one pair per microbatch and boundary)
    n, results = world
    if n != 4:
        pytest.skip("dp=2 x pp=2 needs 4 processes")
    m4, m8 = _ok(results[DP_M4]), _ok(results[DP_M8])
    assert (m4["microbatches"], m8["microbatches"]) == (4, 8)
    assert m4["runtime_counts"]["all_reduce"] == m8["runtime_counts"]["all_reduce"], (m4, m8)
    assert m8["runtime_counts"]["send"] == 2 * m4["runtime_counts"]["send"]
    # the reductions are the plan's step-end ones: one bucket (a flat buffer of the stage's
    # gradients, reduced in place at its last backward) per stage of this rank
    assert m4["plan_step_end"] == m8["plan_step_end"] == {"all_reduce": 1}, (m4, m8)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_zero_pipeline_gathers_and_reduce_scatters_once_a_step(world, schedule):
    # the same with ZeRO-1: each stage's parameters, stored sharded over dp, are all-gathered
    # once before its first forward and its gradients reduce-scattered once after its last
    # backward (one bucket each), so the step's dp collectives (counted at run time on every
    # rank, equal to the plan's by test_runtime_collectives_and_transfers_equal_plan) do not
    # grow with the microbatches; the state is sharded: the parameters are stored Shard on dp.
    # zero-bubble (2 stages per rank): its deferred weight steps add into the same buckets
    n, results = world
    if n != 4:
        pytest.skip("dp=2 x pp=2 needs 4 processes")
    m4, m8 = (_ok(results[c]) for c in ((ZERO_M4, ZERO_M8) if schedule == "1f1b" else (ZB_M4, ZB_M8)))
    assert (m4["microbatches"], m8["microbatches"]) == (4, 8)
    assert m4["schedule"] == m8["schedule"] == schedule
    assert m4["techniques"]["zero"] == m8["techniques"]["zero"] == 1
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert m4["runtime_counts"].get(kind) == m8["runtime_counts"].get(kind), (kind, m4, m8)
    stages = 2 if schedule == "zero-bubble" else 1  # of a rank
    assert m4["plan_step_end"] == m8["plan_step_end"] == {
        "all_gather": stages, "reduce_scatter": stages}, (m4["plan_step_end"], m8["plan_step_end"])
    sharded = [n for n, pl in m4["params"].items() if pl[0].startswith("S")]
    assert len(sharded) >= len(m4["params"]) - 2, m4["params"]  # (a dim that divides by dp)


def test_compiled_pipeline_equals_one_process_and_the_eager_run(world):
    n, results = world
    if n != 2:
        pytest.skip("compiled on 2 processes")
    r, eager = _ok(results[COMPILED]), _ok(results[COMPILED.replace(",compile=1", "")])
    assert_matches_one_process(r, FP32_TOL, COMPILED)  # (inductor reorders fp32 arithmetic)
    assert abs(r["loss"] - eager["loss"]) <= FP32_TOL[0] * max(1.0, abs(eager["loss"])), (r, eager)
    assert r["runtime_counts"] == r["plan_counts"] == eager["runtime_counts"], (r, eager)
    assert r["count_mismatch_ranks"] == 0, r


def test_zero3_pipeline_gathers_every_microbatch_and_fits_its_prediction(world):
    # ZeRO-3 in pipeline stages: the parameters, stored sharded over dp, gathered for every
    # microbatch's forward and again for its backward (2m gathers of each stage's bucket a
    # step, counted at run time equal to the plan by test_runtime_collectives_and_transfers_
    # equal_plan), the gradients reduce-scattered once; loss and gradients equal one process
    # (test_loss_and_every_gradient_match_one_process); the measured peak within part 2's bounds
    from test_equivalence import check_memory

    n, results = world
    if n != 4:
        pytest.skip("dp=2 x pp=2 needs 4 processes")
    for check in ZERO3:
        r = _ok(results[check])
        stages = int(check.split("virtual_stages=")[1].split(",")[0])  # of a rank
        assert r["techniques"]["zero"] == 3 and r["microbatches"] == 4, (check, r["techniques"])
        assert r["plan_step_end"] == {"all_gather": 2 * 4 * stages, "reduce_scatter": stages}, \
            (check, r["plan_step_end"])
        sharded = [n for n, pl in r["params"].items() if pl[0].startswith("S")]
        assert len(sharded) >= len(r["params"]) - 2, r["params"]
    check_memory(results, [*ZERO3, ZERO3_BF16])
    # bf16: the same collectives a step as fp32's, with a second gather bucket where a stage
    # holds weights read in fp32 too (layer norms, embeddings); fewer bytes gathered (the
    # runtime's bytes equal these: test_runtime_collectives_and_transfers_equal_plan)
    bf16, fp32 = _ok(results[ZERO3_BF16]), results[ZERO3[1]]
    assert bf16["plan_step_end"]["reduce_scatter"] == fp32["plan_step_end"]["reduce_scatter"]
    gathers = bf16["plan_step_end"]["all_gather"]
    assert gathers % (2 * 4) == 0 and fp32["plan_step_end"]["all_gather"] <= gathers, bf16["plan_step_end"]
    gathered = [sum(b for kind, _, b, node in r["collectives"]
                    if kind == "all_gather" and node.endswith(" parameters")) for r in (bf16, fp32)]
    assert 0.5 * gathered[1] < gathered[0] < 0.75 * gathered[1], gathered

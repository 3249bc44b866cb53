"""Scale without memory: a 1.5B-parameter GPT is captured and planned from fake tensors.

The planning runs in a child process so that its peak resident memory is measured alone (this
process has already imported and traced other models). It takes about 40 s; the time is printed
(``pytest -s``) but not asserted, because timings on shared machines are noisy. Marked ``slow``
to keep the default suite under 10 minutes (``pytest -m slow tests/unit/test_scale.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import resource, sys, time, torch
    sys.path.insert(0, {tests!r})
    from torch._subclasses.fake_tensor import FakeTensorMode
    import autopar
    from models import GPT
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(vocab=50304, dim=1600, heads=25, layers=48, seq=1024)
    print("PARAMS", sum(p.numel() for p in model.parameters()), flush=True)
    ids = torch.randint(0, 50304, (8, 1024))
    t0 = time.perf_counter()
    plan = autopar.plan(model, autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=8), (ids, ids))
    total = time.perf_counter() - t0
    print("CAPTURE_S", plan.solver["capture_time_s"])
    print("TOTAL_S", total)
    print("DEGREES", plan.degrees["dp"], plan.degrees["tp"], plan.degrees["pp"])
    print("PLAN_PARAMS", len(plan.params))
    print("PEAK_PREDICTED", plan.predicted["peak_memory_bytes"])
    print("RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
""")


def test_plan_1p5b_gpt_without_allocating_weights():
    # generous: about 40 s on an idle machine, several times that on a loaded one
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=TESTS)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    vals = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    for key in ("PARAMS", "CAPTURE_S", "TOTAL_S", "DEGREES", "PLAN_PARAMS", "RSS"):
        assert key in vals, (key, out.stdout[-2000:])
    capture_s, total_s = float(vals["CAPTURE_S"]), float(vals["TOTAL_S"])
    rss = int(vals["RSS"])
    dp, tp, pp = map(int, vals["DEGREES"].split())
    print(f"\n1.5B GPT on a virtual 8 x H100 node: capture {capture_s:.1f} s, planning "
          f"{total_s - capture_s:.1f} s, total {total_s:.1f} s; peak RSS {rss / 2**20:.0f} MiB; "
          f"dp={dp} tp={tp} pp={pp}")
    n = int(vals["PARAMS"])
    assert n >= 1.5e9
    # 48 blocks x 12 parameters + 2 embeddings + final norm (2) + the tied head
    assert int(vals["PLAN_PARAMS"]) == 48 * 12 + 5
    # fp32 weights alone would take 4 bytes x 1.5e9 = 6 GB: under 2 GiB proves none were allocated
    assert rss < 2 * 2**30
    assert dp * tp * pp == 8 and pp == 1
    # predicted per-device memory: Adam training state alone is 16 bytes per parameter, split at
    # most 8 ways; a prediction below that would mean parameters went uncounted
    assert float(vals["PEAK_PREDICTED"]) >= 16 * n / 8


GPT3 = textwrap.dedent("""
    import json, resource, sys, tempfile, os, time
    import autopar
    from autopar.model_presets import megatron_gpt
    model, inputs = megatron_gpt("gpt3-175b", batch=1536, seq=2048)
    t0 = time.perf_counter()
    plan = autopar.plan(model, autopar.Mesh.virtual("a100-dgx", nodes=128), inputs)
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    plan.save(path)
    again = autopar.Plan.load(path)
    names = {n for n, _ in model.named_parameters()}
    stages = plan.pipeline.stages if plan.pipeline is not None else (plan,)
    print(json.dumps({"s": time.perf_counter() - t0, "path": plan.solver["path"],
                      "placed": set(plan.params) == names,
                      "stages_have_nodes": all(bool(s.nodes) for s in stages),
                      "round_trip": again == plan and again.digest() == plan.digest(),
                      "alternatives": len(plan.alternatives),
                      "step_s": plan.predicted["step_time_s"] + plan.predicted["optimizer_s"],
                      "search_step_s": plan.predicted["search_step_time_s"],
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")


def test_gpt3_175b_on_1024_gpus_gets_a_runnable_plan():
    """``autopar.plan`` gives GPT-3 175B on 1,024 virtual A100s a plan with every parameter and
    every stage's operators placed, that survives JSON, in under 2 GB of memory (the time, about
    40 s on this machine, is in docs/validation.md, not asserted)."""
    out = subprocess.run([sys.executable, "-c", GPT3], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n175B planned in {r['s']:.1f} s, peak RSS {r['rss'] / 2**20:.0f} MiB")
    assert r["path"] == "setup search + per-operator ILPs"
    assert r["placed"] and r["stages_have_nodes"] and r["round_trip"] and r["alternatives"] > 0
    assert r["rss"] < 2 * 2**30
    # the per-operator prediction of the chosen setup is the search's price of it: the two
    # models differ only in detail (the per-operator overlap replay, each stage's own ILP under
    # its memory share; on the (dp, tp) mesh its attention keeps a few all-gathers per block
    # that the tp-only layer ILP avoids); measured 9.5% apart (24.16 s vs 22.05 s)
    assert abs(r["step_s"] - r["search_step_s"]) <= 0.10 * r["search_step_s"], r

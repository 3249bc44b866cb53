"""Planning mixture-of-experts models at cluster scale, on this machine, without devices.

    python benchmarks/moe_plan_scale.py                          # both rows, the search only
    python benchmarks/moe_plan_scale.py --rows mixtral-8x7b --plan   # the whole autopar.plan
    python benchmarks/moe_plan_scale.py --rows deepseek-v3 --plan-only   # autopar.plan alone
    python benchmarks/moe_plan_scale.py --rows deepseek-v3-7 --agreement

Rows: Mixtral-8x7B (32 layers, 8 experts, top-2; batch 64 x 4,096) on 64 virtual H100s (8 DGX
nodes), and DeepSeek-V3 (61 layers: 3 dense, then 58 of 256 routed experts, top-8, and a shared
one; low-rank attention; batch 4,096 x 4,096) on 2,048 virtual H100s (256 nodes), both
transformers models built from their published shapes under ``FakeTensorMode`` in bf16. Each row
runs in a fresh process: the setup search (``autopar.planning.search``) and, with ``--plan``,
``autopar.plan`` (the search, then the per-operator placements of the chosen setup). It prints
the search's seconds (traces, layer ILPs, pricing), the best setup and the best one of each ep
degree, and the published setup's price where the row has one (DeepSeek-V3's report: pp=16,
ep=64, no tensor parallelism, ZeRO-1 data parallelism over the rest). ``--agreement`` prices one
setup (dp=2 tp=8 pp=2, selective recomputation, ZeRO-1) of a 7-layer DeepSeek-V3 on 32 GPUs in
closed form and solves its per-operator placements (``autopar.plan`` with the setup forced), and
prints both predictions, step and memory per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

ROWS = {
    "mixtral-8x7b": dict(nodes=8, batch=64, layers=32, published=None),
    "deepseek-v3": dict(nodes=256, batch=4096, layers=61,
                        published=dict(dp=128, tp=1, pp=16, ep=64)),
    # (for --agreement: 3 dense and 4 MoE layers, one setup priced both ways)
    "deepseek-v3-7": dict(nodes=4, batch=256, layers=7, published=None),
}

_CHILD = textwrap.dedent("""
    import json, sys, time
    import autopar
    from autopar.cost_models.training_step import RECOMPUTE, Setup
    from autopar.planning.search import LayerSolver, search
    sys.path.insert(0, sys.argv[4])
    from moe_plan_scale import build
    name, row, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    model, inputs, mesh = build(name)
    out = {}
    gib = lambda c: max(c.rank_memory_bytes) / 2**30
    if mode == "agreement":
        cfg = autopar.Config(dp=2, tp=8, pp=2, ep=1, recompute="selective", zero=1,
                             sequence_parallel=False, schedule="1f1b", microbatch_size=2)
        layers = LayerSolver(model, inputs, mesh, cfg, ())
        res = search(model, inputs, mesh, cfg, layers=layers)
        plan = autopar.plan(model, mesh, inputs, config=cfg)
        out["agreement"] = dict(
            setup=res.best.setup.describe(), search_s=res.best.step_time_s,
            search_gib=[x / 2**30 for x in res.best.stage_memory_bytes],
            plan_s=plan.predicted["step_time_s"],
            plan_gib=[x / 2**30 for x in plan.pipeline.predicted["stage_memory_bytes"]])
        print(json.dumps(out))
        sys.exit(0)
    if mode == "plan-only":  # (autopar.plan alone, in a fresh process: its own time)
        t0 = time.perf_counter()
        plan = autopar.plan(model, mesh, inputs)
        out["plan_only"] = dict(setup=plan.solver["setup"], step_s=plan.predicted["step_time_s"],
                                plan_s=time.perf_counter() - t0, search_s=plan.solver["search_s"],
                                placement_s=plan.solver["placement_s"])
        print(json.dumps(out))
        sys.exit(0)
    t0 = time.perf_counter()
    workers = None if sys.argv[5] == "auto" else int(sys.argv[5])
    layers = LayerSolver(model, inputs, mesh, autopar.Config(), (), workers=workers)
    res = search(model, inputs, mesh, autopar.Config(), layers=layers)
    out["search_s"] = time.perf_counter() - t0
    out["timings"] = res.timings
    out["layer_ilps"], out["evaluated"], out["bounded"] = res.layer_solves, res.evaluated, res.bounded
    out["over"] = res.over_memory
    out["best"] = [res.best.setup.describe(), res.best.step_time_s, gib(res.best)]
    out["per_ep"] = {c.setup.ep: [c.setup.describe(), c.step_time_s, gib(c)]
                     for c in reversed(res.ranked)}
    pub = row["published"]
    if pub:
        dp = pub["dp"]
        setups = [Setup(dp, pub["tp"], pub["pp"], 1, row["batch"] // dp, "1f1b", 1, rc, 1, False,
                        grad_sync="gathered", ep=pub["ep"]) for rc in RECOMPUTE]
        out["published"] = [[c.setup.describe(), c.step_time_s, gib(c), bool(c.fits)]
                            for c in (layers.price(s) for s in setups)]
    if mode == "plan":
        t1 = time.perf_counter()
        try:
            plan = autopar.plan(model, mesh, inputs)
            out["plan"] = [plan.solver["setup"], plan.predicted["step_time_s"],
                           plan.predicted["peak_memory_bytes"] / 2**30]
        except autopar.PlanError as e:
            out["plan"] = ["no plan: " + str(e).splitlines()[0][:300]]
        out["plan_s"] = time.perf_counter() - t1
    print(json.dumps(out))
""")


def build(name: str) -> tuple[Any, dict[str, Any], Any]:
    """Row ``name``'s model (transformers, from its published shapes, bf16, under
    ``FakeTensorMode``), one global batch of 4,096-token sequences and its virtual H100 mesh."""
    import torch
    import transformers as tf
    from torch._subclasses.fake_tensor import FakeTensorMode

    import autopar

    row = ROWS[name]
    if name == "mixtral-8x7b":
        cfg = tf.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=row["layers"], num_attention_heads=32,
                               num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                               max_position_embeddings=4096)
        cls = tf.MixtralForCausalLM
    else:
        cfg = tf.DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=row["layers"], num_attention_heads=128, num_key_value_heads=128,
            n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
            topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            max_position_embeddings=4096)
        cls = tf.DeepseekV3ForCausalLM
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = cls(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        ids = torch.zeros(row["batch"], 4096, dtype=torch.long)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=row["nodes"], gpus_per_node=8)
    return model, {"input_ids": ids, "labels": ids}, mesh


def main() -> None:
    """Run each row in a fresh process and print what it found."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=["mixtral-8x7b", "deepseek-v3"], choices=list(ROWS))
    ap.add_argument("--plan", action="store_true", help="also run the whole autopar.plan")
    ap.add_argument("--plan-only", action="store_true",
                    help="only the whole autopar.plan, timed in a fresh process")
    ap.add_argument("--agreement", action="store_true",
                    help="one setup's closed-form price against its per-operator plan")
    ap.add_argument("--workers", default="auto",
                    help="processes solving layer costs ahead of the search (LayerSolver.workers; "
                         "default: one fewer than the CPUs; 0: none)")
    args = ap.parse_args()
    mode = "agreement" if args.agreement else "plan-only" if args.plan_only else \
        "plan" if args.plan else "search"
    for name in args.rows:
        proc = subprocess.run([sys.executable, "-c", _CHILD, name, json.dumps(ROWS[name]), mode,
                               os.path.dirname(os.path.abspath(__file__)), args.workers],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        if "agreement" in out:
            a = out["agreement"]
            print(f"{name}: {a['setup']}\n  search: step {a['search_s']:.2f} s, stages "
                  f"{', '.join(f'{g:.1f}' for g in a['search_gib'])} GiB\n  per operator: step "
                  f"{a['plan_s']:.2f} s, stages {', '.join(f'{g:.1f}' for g in a['plan_gib'])} GiB")
            continue
        if "plan_only" in out:
            p = out["plan_only"]
            print(f"{name}: autopar.plan in {p['plan_s']:.1f} s (search {p['search_s']:.1f} s, "
                  f"placements {p['placement_s']:.1f} s): {p['setup']}, predicted step "
                  f"{p['step_s']:.2f} s")
            continue
        t = out["timings"]
        print(f"{name}: search {out['search_s']:.1f} s with {t['workers']} worker(s) (traces "
              f"{t['trace_s']:.1f}, {out['layer_ilps']} layer ILPs {t['layer_ilp_s']:.1f}, "
              f"pricing {t['price_s']:.1f}; {out['evaluated']} setups, {out['over']} of them set "
              f"aside by their memory floor, {out['bounded']} skipped by their bound)")
        print(f"  best: {out['best'][0]}  {out['best'][1]:.2f} s  {out['best'][2]:.1f} GiB")
        for ep, (setup, s, gib) in sorted(out["per_ep"].items(), key=lambda kv: int(kv[0])):
            print(f"  best with ep={ep}: {setup}  {s:.2f} s  {gib:.1f} GiB")
        for setup, s, gib, fits in out.get("published", []):
            print(f"  published degrees: {setup}  {s:.2f} s  {gib:.1f} GiB"
                  f"{'' if fits else ' (does not fit)'}")
        if "plan" in out:
            print(f"  autopar.plan: {out['plan']} in {out['plan_s']:.1f} s")


if __name__ == "__main__":
    main()

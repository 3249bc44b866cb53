"""Runs many parallel-vs-single-process checks in one torchrun job (one process group for all).

Usage: torchrun --nproc_per_node=N worker.py OUT.json CHECK [CHECK ...]
A CHECK is ``kind:key=value,key=value`` (kind in mlp, gpt, gpt2, llama, t5, bart, pegasus, marian, mbart; keys: dp, tp, pp,
schedule, virtual_stages, microbatch_size, recompute, zero, sequence_parallel (0/1), cp_inside_tp (0/1), ep_in_cp (0/1), cp_attention,
mixed_precision for the Config, dim/batch/seq/layers/heads/explicit (attention)/tied for the model, topo for the topology
preset; memory=1 also measures the peak memory of a step, curve=1 records a 20-step loss curve
instead), ``example:NAME`` to run a training example of ``examples/`` (``examples_check.py``), or
``ckpt:MODEL|PLAN|PLAN...`` to save a checkpoint under one plan and load it under others
(``checkpoint_check.py``), or ``prof:CHECK`` to profile the check's plan (``run_profile``).
``worker.py --serve PORT DIR`` runs the checks a test sends over a socket instead (``serve``).
Rank 0 writes one JSON record per check; an exception in a check is recorded, not raised, so one failure does
not hide the others.
"""

from __future__ import annotations

import contextlib
from typing import Any
from collections import Counter
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.profile import CommMeter  # noqa: E402
from autopar.capture import extract_loss  # noqa: E402
from checkpoint_check import run_checkpoint  # noqa: E402
from collective_bytes import routing_independent  # noqa: E402
from examples_check import run_example  # noqa: E402
from grads import compare_on_every_rank  # noqa: E402
from models import build, slow_compute  # noqa: E402

_MODEL_KEYS = {"dim", "batch", "seq", "layers", "heads", "d_in", "d_hidden", "d_out", "explicit",
               "tied", "kernel"}
_RUN_KEYS = {"compile", "memory", "curve"}
_TEXT_KEYS = {"schedule", "recompute", "mixed_precision", "cp_attention", "cp_layout"}


def _parse(check: str) -> tuple[str, dict, dict, str]:
    kind, _, rest = check.partition(":")
    cfg, mk, topo = {}, {}, "slow-compute"
    for item in filter(None, rest.split(",")):
        k, v = item.split("=")
        if k == "topo":
            topo = v
        elif k in _RUN_KEYS:
            mk["_" + k] = bool(int(v))
        elif k in _MODEL_KEYS:
            mk[k] = int(v)
        elif k in ("sequence_parallel", "cp_inside_tp", "ep_in_cp"):
            cfg[k] = bool(int(v))
        else:
            cfg[k] = v if k in _TEXT_KEYS else int(v)
    return kind, cfg, mk, topo


def topology(name: str):
    """A preset, or ``slow-compute`` (:func:`models.slow_compute`: the solver shards every op
    it can)."""
    return slow_compute() if name == "slow-compute" else name


def _precision(cfg: dict):
    """The single-process reference's precision: bf16 autocast when the plan asks for it."""
    if cfg.get("mixed_precision") == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def run_check(check: str) -> dict:
    kind, cfg, mk, topo = _parse(check)
    compile = mk.pop("_compile", False)
    memory = mk.pop("_memory", False)
    if mk.pop("_curve", False):
        return run_curve(kind, cfg, mk, topo)
    model, inputs = build(kind, **dict(mk))
    ref, _ = build(kind, **dict(mk))
    with _precision(cfg):
        ref_out = _call(ref, inputs)
    ref_loss = extract_loss(ref_out)
    ref_loss.backward()
    mesh = autopar.Mesh.from_torchrun(topology=topology(topo))
    t0 = time.perf_counter()
    pm = autopar.parallelize(model, mesh, inputs, config=autopar.Config(**cfg), compile=compile)
    if compile:  # compile outside the counting mode (its tracing would be counted too)
        pm.step(**inputs) if isinstance(inputs, dict) else pm.step(*inputs)
        for p in pm.parameters():
            p.grad = None
    setup_s = time.perf_counter() - t0
    if pm.plan.pipeline is not None:
        record = _pipeline_record(pm, model, ref, inputs, ref_loss, setup_s)
        return (run_memory(pm, inputs) if memory else {}) | record
    with CommMeter() as meter:
        loss = _call(pm.step, inputs) if not isinstance(inputs, dict) else pm.step(**inputs)
    ref_grads = dict(ref.named_parameters())
    grads = compare_on_every_rank(pm, ref, loss, ref_loss)
    runtime = dict(meter.counts)
    # the same plan through forward with autograd, then loss.backward()
    for p in pm.parameters():
        p.grad = None
    out2 = pm(**inputs) if isinstance(inputs, dict) else pm(*inputs)
    assert type(out2) is type(ref_out), (type(out2), "returns what the model returns")
    loss2 = extract_loss(out2)
    loss2.backward()
    grads |= compare_on_every_rank(pm, ref, loss2, ref_loss, prefix="autograd_")
    plan = pm.plan
    per_layer: dict[str, dict[str, int]] = {}
    for c in plan.collectives:
        key = f"{c.layer}|{c.phase}|{c.axis}|{c.kind}"
        per_layer[key] = per_layer.get(key, 0) + 1
    record = run_memory(pm, inputs) if memory else {}
    return record | grads | {
        "loss": loss.item(), "ref_loss": ref_loss.item(), "autograd_loss": loss2.item(), "degrees": plan.degrees, "mesh_shape": list(plan.mesh_shape),
        "axis_names": list(plan.axis_names), "params": {k: list(v) for k, v in plan.params.items()},
        "runtime_counts": runtime, "plan_counts": dict(plan.collective_counts()),
        "runtime_bytes": dict(meter.bytes), "plan_bytes": dict(plan.collective_bytes()),
        "runtime_bytes_all_ranks": _sum_over_ranks(dict(meter.bytes)),
        "plan_bytes_all_ranks": _sum_over_ranks(dict(plan.collective_bytes())),
        "per_layer": per_layer, "warnings": list(plan.warnings), "setup_s": setup_s, "startup": {k: v for k, v in pm.startup.items() if isinstance(v, (int, float, str))},
        "techniques": dict(plan.techniques),
        # the parameter elements the rank holds between steps (the most of any rank), and the
        # model's (a tied parameter once)
        "held_elements": int(_max_over_ranks(sum(p.to_local().numel() for p in pm.parameters()))),
        "ref_elements": sum(p.numel() for p in ref.parameters()),
        "collectives": [[c.kind, c.phase, c.bytes, c.node] for c in plan.collectives],
        "grad_buckets": [list(b) for b in plan.grad_buckets],
        "param_bytes": [p.numel() * p.element_size() for p in ref.parameters()],
        "n_params": len(list(pm.named_parameters())), "ref_n_params": len(ref_grads),
    } | _cp_held(pm, inputs)


def _cp_held(pm: Any, inputs: Any) -> dict:
    """With a cp axis: the first input's first row, whole and as rank 0 holds it (which
    positions the plan's layout gave rank 0), and how many forward linears split their rows on
    dp and cp both."""
    if pm.plan.degrees.get("cp", 1) == 1:
        return {}
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    flat = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]
    local = pm._local_inputs(args, kwargs)
    first = next(i for i, x in enumerate(flat) if x.dim() >= 2)
    plan = pm.plan
    linears = [p for p in plan.nodes.values() if p.op in ("aten.mm", "aten.addmm")
               and p.phase == "forward"]
    rows = [p.inputs[-2 if p.op == "aten.addmm" else 0] for p in linears]
    dp_cp = [plan.axis_names.index(a) for a in ("dp", "cp") if a in plan.axis_names]
    return {"cp_whole_row": flat[first][0].tolist(), "cp_held_row": local[first][0].tolist(),
            # the forward linears, and those whose rows are split on dp and cp both (nested)
            "cp_linears": len(linears),
            "cp_nested_linears": sum(len(dp_cp) == 2 and all(r[a] == "S(0)" for a in dp_cp)
                                     for r in rows)}


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sum_over_ranks(counts: dict) -> dict:
    """Each kind's figure (a count or bytes) summed over the ranks (the kinds some rank has)."""
    kinds = ["all_gather", "all_reduce", "all_to_all", "broadcast", "recv", "reduce_scatter", "send"]
    t = torch.tensor([float(counts.get(k, 0)) for k in kinds], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: int(v) for k, v in zip(kinds, t.tolist()) if v}


def _pipeline_record(pm, model, ref, inputs, ref_loss, setup_s: float) -> dict:
    """Loss and every gradient (each rank checks the parameters it holds) and the collectives
    of one step against the plan's, per pipeline rank."""
    step = (lambda: pm.step(**inputs)) if isinstance(inputs, dict) else (lambda: pm.step(*inputs))
    loss = step()
    ref_grads = dict(ref.named_parameters())
    grads = compare_on_every_rank(pm, ref, loss, ref_loss)
    held = torch.tensor([len(list(pm.named_parameters()))])
    for p in pm.parameters():
        p.grad = None
    with CommMeter() as meter:  # the second step: the first also exchanges metadata
        loss2 = step()
    plan = pm.plan
    expected = dict(plan.collective_counts(pp_rank=pm.pp_rank))
    expected_bytes = dict(plan.collective_bytes(pp_rank=pm.pp_rank))
    mismatch = torch.tensor([float(meter.counts != expected or routing_independent(meter.bytes)
                                   != routing_independent(expected_bytes))])
    dist.all_reduce(mismatch)
    names = {n for n, _ in pm.named_parameters()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(names))
    pipe = plan.pipeline
    # the stages' joint graphs as parallelize traced them (cached in this process)
    from autopar.planning.pipeline import forward_for_plan

    bf16_ops = sum(1 for _, traced in forward_for_plan(model, inputs, plan)[1]
                   for n in traced.gm.graph.nodes if n.op == "call_function"
                   and getattr(n.meta.get("val"), "dtype", None) == torch.bfloat16)
    return grads | {
        "techniques": dict(plan.techniques), "stage_bf16_ops": int(_max_over_ranks(bf16_ops)),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in pm.parameters() if p.grad is not None}),
        "loss": loss.item(), "ref_loss": ref_loss.item(), "loss_again": loss2.item(), "degrees": plan.degrees,
        "params_covered": len(set().union(*map(set, gathered))), "ref_n_params": len(ref_grads),
        "held_params": int(held.item()), "runtime_counts": dict(meter.counts), "plan_counts": expected,
        "runtime_bytes": dict(meter.bytes), "plan_bytes": expected_bytes,
        "runtime_bytes_all_ranks": _sum_over_ranks(dict(meter.bytes)),
        "plan_bytes_all_ranks": _sum_over_ranks(dict(expected_bytes)),
        "count_mismatch_ranks": int(mismatch.item()), "schedule": pipe.schedule,
        "microbatches": pipe.microbatches, "virtual_stages": pipe.virtual_stages,
        "stage_of_unit": list(pipe.stage_of_unit), "units": list(pipe.units),
        "mesh_shape": list(plan.mesh_shape), "axis_names": list(plan.axis_names),
        "setup_s": setup_s, "params": {k: list(v) for k, v in plan.params.items()},
        "collectives": [[c.kind, c.phase, c.bytes, c.node] for c in plan.collectives],
        "predicted_step_s": plan.predicted["step_time_s"],
        # dp collectives the plan lists for this rank's stages once a step, by kind (a bucket's
        # reduction after the stage's last backward; with ZeRO-1 its gather before the first)
        "plan_step_end": dict(Counter(c.kind for c in plan.collectives if c.axis == "dp"
                                      and c.stage is not None and c.node.endswith(("gradients", "parameters"))
                                      and c.stage % plan.degrees["pp"] == pm.pp_rank)),
    }


def run_memory(pm, inputs) -> dict:
    """Peak memory of a training step (forward, backward, AdamW step) on every rank, measured
    with autopar.runtime.memory, against the plan's prediction for that rank (a pipeline's
    differs per pipeline rank: the sum over its stages)."""
    from autopar.runtime.memory import measure_peak_memory

    opt = torch.optim.AdamW(pm.parameters())

    def step() -> None:
        pm.step(**inputs) if isinstance(inputs, dict) else pm.step(*inputs)
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as the model counts them

    step()  # the first step allocates the optimizer state
    report = measure_peak_memory(step, pm, opt, *[x for x in (inputs.values() if isinstance(
        inputs, dict) else inputs)], per_module=pm.plan.pipeline is None)
    plan = pm.plan
    predicted = plan.predicted["peak_memory_bytes"] if plan.pipeline is None else \
        plan.pipeline.predicted["peak_memory_bytes"][pm.pp_rank]
    peaks = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([float(report.peak_bytes), predicted], dtype=torch.float64))
    return {"measured": [float(p[0]) for p in peaks], "by_kind_rank0": report.by_kind,
            "predicted_per_rank": [float(p[1]) for p in peaks],
            "predicted": plan.predicted["peak_memory_bytes"]}


def run_curve(kind: str, cfg: dict, mk: dict, topo: str, steps: int = 20) -> dict:
    """Losses of ``steps`` AdamW steps, parallel and single-process (same precision, same data)."""
    model, inputs = build(kind, **dict(mk))
    ref, _ = build(kind, **dict(mk))
    pm = autopar.parallelize(model, autopar.Mesh.from_torchrun(topology=topology(topo)), inputs,
                             config=autopar.Config(**cfg))
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for _ in range(steps):
        loss = pm.step(**inputs) if isinstance(inputs, dict) else pm.step(*inputs)
        opt.step()
        opt.zero_grad()
        with _precision(cfg):
            ref_loss = extract_loss(_call(ref, inputs))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "degrees": pm.plan.degrees,
            "techniques": pm.plan.techniques}


def run_self_check() -> dict:
    """The comparison itself can fail: a dp=2 step whose rank 1 holds one wrong gradient, on the
    parameter with the smallest gradients, 0.1% off (what a missed reduction on one rank or a
    wrong slice looks like, only smaller)."""
    model, inputs = build("gpt")
    ref, _ = build("gpt")
    ref_loss = ref(*inputs)
    ref_loss.backward()
    pm = autopar.parallelize(model, autopar.Mesh.from_torchrun(), inputs, config=autopar.Config(dp=2))
    loss = pm.step(*inputs)
    scales = {n: p.grad.abs().max().item() for n, p in ref.named_parameters()}
    smallest = min(scales, key=scales.get)
    if dist.get_rank() == 1:
        dict(pm.named_parameters())[smallest].grad.to_local().mul_(1.001)
    return compare_on_every_rank(pm, ref, loss, ref_loss) | {"perturbed": f"{smallest}@1"}


def run_cp_moves() -> dict:
    """The balanced cp layout's moves (passes.lower.reshard with a SequenceLayout) on a 1-D mesh
    of every rank: per move, the largest error of the rank's block against the values at its
    chunk pairs (per part of a strided split), and of the value gathered back (0 when right)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from autopar._torch_private import _StridedShard
    from autopar.passes.lower import reshard
    from autopar.sequence_layout import SequenceLayout

    n, me = dist.get_world_size(), dist.get_rank()
    mesh, layout = init_device_mesh("cpu", (n,)), SequenceLayout(0, n)
    torch.manual_seed(0)  # (every rank the same values)
    x = torch.randn(2, 8 * n, 8 * n)

    def expected(value: torch.Tensor, p) -> torch.Tensor:  # the rank's block of ``value``
        parts = getattr(p, "split_factor", 1)
        part = value.shape[p.dim] // parts
        idx = torch.cat([k * part + layout.positions(part, me * part // n, part // n)
                         for k in range(parts)])
        return value.index_select(p.dim, idx)

    start = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    out = {}
    for a, b in [(Replicate(), Shard(1)), (Shard(1), Shard(2)), (Shard(2), Shard(1)),
                 (Shard(1), _StridedShard(2, split_factor=2)),
                 (Replicate(), _StridedShard(1, split_factor=2))]:
        moved = reshard(reshard(start, (a,), mesh, layout), (b,), mesh, layout)
        back = reshard(moved, (Replicate(),), mesh, layout).to_local()
        out[f"{a}->{b}"] = max((moved.to_local() - expected(x, b)).abs().max().item(),
                               (back - x).abs().max().item())
    partial = DTensor.from_local(x * (me + 1), mesh, (Partial(),), run_check=False)
    summed = x * n * (n + 1) / 2
    moved = reshard(partial, (Shard(1),), mesh, layout).to_local()
    out["P->S(1)"] = (moved - expected(summed, Shard(1))).abs().max().item()
    return {"moves": out}


def run_errors() -> dict:
    """Bad input in a real job: a mesh of another size, a saved plan of another model or mesh,
    and call-time inputs unlike the plan's."""
    model, inputs = build("gpt")
    world = dist.get_world_size()
    out = {}
    try:
        autopar.parallelize(model, autopar.Mesh.virtual("cpu-gloo", nodes=1, gpus_per_node=world + 1),
                            inputs)
        out["mesh"] = "no error"
    except autopar.MeshError as e:
        out["mesh"] = str(e)
    pm = autopar.parallelize(model, autopar.Mesh.from_torchrun(), inputs)
    # a saved plan of another model, and one made for another mesh
    other, other_inputs = build("gpt", layers=3)
    four = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2 * world), inputs)
    for name, args, plan in (("plan_model", (other, autopar.Mesh.from_torchrun(), other_inputs), pm.plan),
                             ("plan_mesh", (model, autopar.Mesh.from_torchrun(), inputs), four)):
        try:
            autopar.parallelize(*args, plan=plan)
            out[name] = "no error"
        except (autopar.PlanError, autopar.MeshError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    # ranks that planned differently (here: other degrees): both stop before the first step,
    # and the error names the difference
    rank_plan = autopar.plan(model, autopar.Mesh.from_torchrun(), inputs,
                             config=autopar.Config(tp=world) if dist.get_rank() == 0 else
                             autopar.Config(dp=world))
    try:
        autopar.parallelize(model, autopar.Mesh.from_torchrun(), inputs, plan=rank_plan)
        mine = "no error"
    except autopar.PlanError as e:
        mine = str(e)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    out["plans_differ"] = every
    # ranks that would plan differently (another Config): every rank stops before planning
    try:
        autopar.parallelize(model, autopar.Mesh.from_torchrun(), inputs,
                            config=autopar.Config(tp=world) if dist.get_rank() == 0 else
                            autopar.Config(dp=world))
        mine = "no error"
    except autopar.PlanError as e:
        mine = str(e)
    every = [None] * world
    dist.all_gather_object(every, mine)
    out["problems_differ"] = every
    ids, tgt = inputs
    for name, bad in (("shape", (ids[:, :8], tgt[:, :8])), ("dtype", (ids.int(), tgt)),
                      ("arity", (ids,))):
        try:
            pm.step(*bad)
            out[name] = "no error"
        except autopar.InputMismatchError as e:
            out[name] = str(e)
    return out


def run_profile(check: str) -> dict:
    """``prof:CHECK``: autopar.profile_step of the check's plan, inside torch.profiler."""
    kind, cfg, mk, topo = _parse(check)
    model, inputs = build(kind, **mk)
    pm = autopar.parallelize(model, autopar.Mesh.from_torchrun(topology=topology(topo)), inputs,
                             config=autopar.Config(**cfg))
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    with torch.profiler.profile() as prof:
        profile = autopar.profile_step(pm, *args, steps=2, **kwargs)
    names = sorted({e.name for e in prof.events() if e.name.startswith("autopar")})
    return {"times": profile.times, "comm": profile.comm, "table": str(profile),
            "profiler_ranges": names, "pipelined": pm.plan.pipeline is not None,
            "grads_cleared": all(p.grad is None for p in pm.parameters())}


def run_one(check: str, workdir: str) -> dict:
    """Run one CHECK on every rank; rank 0's record (an exception is recorded, not raised)."""
    t0 = time.perf_counter()
    try:
        if check.startswith("example:"):
            record = run_example(check.split(":", 1)[1], workdir)
        elif check.startswith("ckpt:"):
            record = run_checkpoint(check.split(":", 1)[1], workdir)
        elif check.startswith("prof:"):
            record = run_profile(check.split(":", 1)[1])
        else:
            record = {"errors": run_errors, "self_check": run_self_check,
                      "cp_moves": run_cp_moves}.get(check, lambda: run_check(check))()
    except Exception as e:  # recorded for the test to report; the job goes on
        record = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(f"rank {dist.get_rank()}: {check}: {record['trace']}", file=sys.stderr, flush=True)
    record["wall_s"] = time.perf_counter() - t0
    dist.barrier()
    return record


def serve(port: int, workdir: str) -> None:
    """Run the checks a test sends, one per line, to 127.0.0.1:PORT (rank 0 connects); answer
    each with rank 0's record as one JSON line. An empty line ends the job. One job serves many
    checks chosen at test time (hypothesis), paying the process start once."""
    import socket

    conn = socket.create_connection(("127.0.0.1", port)) if dist.get_rank() == 0 else None
    lines = conn.makefile("r") if conn is not None else None
    while True:
        box = [lines.readline().strip() if lines is not None else None]
        dist.broadcast_object_list(box, src=0)
        if not box[0]:
            break
        record = run_one(box[0], workdir)
        if conn is not None:
            conn.sendall((json.dumps(record) + "\n").encode())
    if conn is not None:
        conn.close()


def main() -> None:
    dist.init_process_group("gloo")
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), sys.argv[3])
    else:
        out, checks = sys.argv[1], sys.argv[2:]
        results = {check: run_one(check, os.path.dirname(out)) for check in checks}
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

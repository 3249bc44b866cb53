"""autopar on one CUDA GPU: equivalence, kernel times against the cost model, a 1B-parameter step.

    python benchmarks/gpu_check.py [--json out.json] [--quick]

Runs in one process (an NCCL process group of one rank, made here when the script is not under
``torchrun``) and prints one table per part:

1. **equivalence**: the GPT-2-style model of ``runtime_vs_torch.py`` (dim 256, 2 layers, seq 128,
   batch 8) planned by autopar for this GPU, eager and compiled, fp32 and bf16 autocast; loss
   and every gradient against the same model run eagerly by PyTorch on the same GPU. TF32 is
   off, so fp32 matmuls are fp32 on both sides. Tolerances: fp32 1e-4 relative per parameter
   (inductor fuses and reorders reductions: rounding of order 1e-7 per add over thousands of
   adds), bf16 3e-2 (8 mantissa bits: 3.9e-3 per rounding, and the compiled program rounds at
   other points than eager does).
2. **kernels**: the GEMMs, the attention and the pointwise ops of the 1B model's layer, timed
   with CUDA events (median of 20 after 5 warm-ups), next to the cost model's roofline time for
   the topology preset of this GPU (:func:`autopar.cost_models.compute.op_time`).
3. **calibration**: the compute calibration of ``python -m autopar calibrate``
   (:func:`autopar.calibrate.time_kernels`, :func:`autopar.cost_models.calibration.fit_compute`):
   every distinct operator of the 1B model's bf16 joint graph timed on this GPU, the preset's
   matmul and pointwise efficiencies fitted to them; measured against the preset's and the
   calibrated topology's times; and the pointwise efficiency fitted again on the compiled
   step's kernels outside GEMMs and attention (``calibrate --compiled``).
4. **1B step**: a GPT of 1.03B parameters (dim 2560, 12 layers, 20 heads, vocab 32768, seq 2048,
   batch 4) planned by autopar for this GPU with bf16 autocast and compiled; its measured step
   (forward and backward, median of 10 after 3 warm-ups) and peak memory (with AdamW states)
   against the plan's prediction (and, after part 3, the prediction of the same model planned on
   the calibrated topology), and the same model under ``torch.compile`` as a baseline; each
   step's kernel time by kind (GEMMs, attention, inductor's fused kernels) from the profiler.

5. **cp kernels**: context parallelism's attention blocks run with this GPU's cuDNN,
   FlashAttention and memory-efficient kernels, 2 and 4 cp ranks simulated in one process,
   both forms and layouts, against float64 attention (:func:`cp_kernels`); and one rank's
   gathered attention timed against its price (:func:`cp_timing`).

Every part records its error instead of its figures when it fails, so one broken part does not
hide the others; the exit status is 1 when any part failed or any check missed its tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime_vs_torch import make_batch, make_model  # noqa: E402

import autopar  # noqa: E402
from autopar.calibrate import (ATTENTION_KERNEL_WORDS, GEMM_KERNEL_WORDS,  # noqa: E402
                               base_preset_for, free_port, time_compiled_step, time_kernels)
from autopar.cost_models.calibration import fit_compute, is_attention, step_seconds  # noqa: E402
from autopar.cost_models.compute import op_time  # noqa: E402
from autopar.cost_models.topology import Topology, custom, get_preset  # noqa: E402
from autopar.numerics import gradient_error, gradient_floor  # noqa: E402
from autopar.passes.cp_simulation import Attention  # noqa: E402

SMALL = dict(dim=256, heads=4, layers=2, seq=128, batch=8, vocab=1024)
ONE_B = dict(dim=2560, heads=20, layers=12, seq=2048, batch=4, vocab=32768)
QUICK_B = dict(dim=1024, heads=8, layers=4, seq=1024, batch=4, vocab=32768)
TINY = dict(dim=32, heads=2, layers=2, seq=16, batch=4, vocab=64)
DEVICE = "cuda"  # "cpu" with --cpu: the script's own smoke test, at tiny sizes, on gloo
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


def preset_for() -> str:
    """The topology preset of this GPU by its CUDA name (``h100-dgx`` when none matches)."""
    try:
        return base_preset_for("cuda")
    except ValueError:  # another GPU: the check still runs, priced as an H100 (said in its facts)
        return "h100-dgx"


# the topology part 3 fits (part 4 plans on it too)
CALIBRATED: dict[str, Topology] = {}


def one_rank_group() -> None:
    """A process group of one rank (NCCL, or gloo with ``--cpu``), unless ``torchrun`` made the
    environment."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def cuda_time(fn: Callable[[], Any], repeats: int = 20, warmup: int = 5) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    if DEVICE == "cpu":
        return statistics.median(_wall(fn) for _ in range(repeats))
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _wall(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _batch(size: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(x.to(DEVICE) for x in make_batch(size))


def _grad_errors(params: Any, ref: torch.nn.Module) -> tuple[float, str]:
    """Largest per-parameter gradient error over ``params`` (name, parameter) against ``ref``
    (``autopar.numerics.gradient_error``, the equivalence tests' rule) and its parameter."""
    want = dict(ref.named_parameters())
    floor = gradient_floor(p.grad for p in want.values())
    worst, where = 0.0, ""
    for name, p in params:
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = gradient_error(g, want[name].grad, floor)
        if err >= worst:
            worst, where = err, name
    return worst, where


def _reference(size: dict, ids: torch.Tensor, tgt: torch.Tensor, bf16: bool) -> tuple[Any, Any]:
    """PyTorch eager on this device: the model and its loss after one backward."""
    ref = make_model(size).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=bf16):
        loss = ref(ids, tgt)
    loss.backward()
    return ref, loss.detach()


def equivalence(size: dict, mesh: autopar.Mesh) -> list[dict]:
    """Part 1: autopar's one-GPU program against PyTorch eager, per precision and mode.

    fp32: autopar against eager fp32 (tolerance ``TOLERANCE["fp32"]``). bf16: both bf16 runs
    are also measured against eager fp32, and autopar passes when its error is at most twice
    eager bf16's (two programs that round at different points, each error of the same order)
    and its loss within ``TOLERANCE["bf16"]`` of eager bf16's.
    """
    rows = []
    ids, tgt = _batch(size)
    fp32, fp32_loss = _reference(size, ids, tgt, bf16=False)
    bf16, bf16_loss = _reference(size, ids, tgt, bf16=True)
    eager_bf16_err = _grad_errors(bf16.named_parameters(), fp32)[0]
    for precision, ref, ref_loss in (("fp32", fp32, fp32_loss), ("bf16", bf16, bf16_loss)):
        for compile in (False, True):
            row = {"precision": precision, "compiled": compile}
            try:
                config = autopar.Config(mixed_precision="bf16" if precision == "bf16" else None)
                pm = autopar.parallelize(make_model(size).to(DEVICE), mesh, (ids, tgt), config=config,
                                         compile=compile, plan_cache=False)
                loss = pm.step(ids, tgt)
                err, where = _grad_errors(pm.named_parameters(), ref)
                row |= {"loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                        "grad_rel": err, "worst": where, "tolerance": TOLERANCE[precision]}
                row["ok"] = row["loss_err"] <= row["tolerance"] and err <= row["tolerance"]
                if precision == "bf16":
                    vs_fp32 = _grad_errors(pm.named_parameters(), fp32)[0]
                    row |= {"vs_fp32": vs_fp32, "eager_bf16_vs_fp32": eager_bf16_err,
                            "ok": row["loss_err"] <= row["tolerance"] and vs_fp32 <= 2 * eager_bf16_err}
            except Exception:  # recorded and reported: the part fails, the others still run
                row |= {"ok": False, "error": traceback.format_exc(limit=-4)}
            rows.append(row)
            print(row, flush=True)
    return rows


def _gemm(m: int, k: int, n: int, dtype: torch.dtype) -> Callable[[], Any]:
    a, b = torch.randn(m, k, device=DEVICE, dtype=dtype), torch.randn(k, n, device=DEVICE, dtype=dtype)
    return lambda: a @ b


def kernels(size: dict, topo_name: str) -> list[dict]:
    """Part 2: the layer's kernels timed against the roofline of ``topo_name``."""
    topo = get_preset(topo_name)
    t, d, v = size["batch"] * size["seq"], size["dim"], size["vocab"]
    rows = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        elt = torch.finfo(dtype).bits // 8
        for what, (m, k, n) in {"qkv/proj": (t, d, d), "fc1": (t, d, 4 * d),
                                "fc2": (t, 4 * d, d), "lm head": (t, d, v)}.items():
            flops = 2 * m * k * n
            measured = cuda_time(_gemm(m, k, n, dtype))
            predicted = op_time(flops, (m * k + k * n + m * n) * elt, topo, name)
            rows.append({"kernel": f"{what} {m}x{k}x{n}", "dtype": name, "measured_ms": measured * 1e3,
                         "predicted_ms": predicted * 1e3, "tflops": flops / measured / 1e12})
    h = size["heads"]
    q, k_, v_ = (torch.randn(size["batch"], h, size["seq"], d // h, device=DEVICE,
                             dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    # the cost model counts attention's FLOPs without the causal discount (compute.py [TFC])
    fwd_flops = 4 * size["batch"] * h * size["seq"] ** 2 * (d // h)
    io = 4 * q.numel() * 2
    out = F.scaled_dot_product_attention(q, k_, v_, is_causal=True)
    grad = torch.randn_like(out)
    for what, fn, flops in (
            ("sdpa causal fwd", lambda: F.scaled_dot_product_attention(q, k_, v_, is_causal=True), fwd_flops),
            ("sdpa causal bwd", lambda: torch.autograd.grad(out, (q, k_, v_), grad, retain_graph=True),
             2.5 * fwd_flops)):
        measured = cuda_time(fn)
        rows.append({"kernel": what, "dtype": "bf16", "measured_ms": measured * 1e3,
                     "predicted_ms": op_time(flops, io, topo, "bf16") * 1e3,
                     "tflops": flops / measured / 1e12})
    x = torch.randn(t, d, device=DEVICE, dtype=torch.bfloat16)
    w = torch.ones(d, device=DEVICE, dtype=torch.bfloat16)
    h4 = torch.randn(t, 4 * d, device=DEVICE, dtype=torch.bfloat16)
    for what, fn, moved in (("layer_norm", lambda: F.layer_norm(x, (d,), w, w), 2 * x.numel() * 2),
                            ("gelu", lambda: F.gelu(h4), 2 * h4.numel() * 2)):
        measured = cuda_time(fn)
        rows.append({"kernel": f"{what} bf16", "dtype": "bf16", "measured_ms": measured * 1e3,
                     "predicted_ms": op_time(0, moved, topo, "bf16", is_matmul=False) * 1e3,
                     "tflops": 0.0, "GBps": moved / measured / 1e9})
    for row in rows:
        row["pred/meas"] = row["predicted_ms"] / row["measured_ms"]
    return rows


def calibration(size: dict, topo_name: str) -> list[dict]:
    """Part 3: the operators of ``size``'s bf16 graph timed on this device, the preset's two
    efficiencies fitted to them (``python -m autopar calibrate``'s compute fit)."""
    base = get_preset(topo_name)
    timed, failed = time_kernels(make_model(size), make_batch(size), torch.device(DEVICE),
                                 reps=5, mixed_precision="bf16")
    fit = fit_compute(timed, base)
    topo = CALIBRATED["topology"] = custom(
        f"calibrated-{base.name}", base=base, matmul_efficiency=fit.matmul_efficiency,
        pointwise_efficiency=fit.pointwise_efficiency)
    compiled_fit = None
    if DEVICE == "cuda":  # the pointwise efficiency fitted on the compiled step's fused kernels
        step = time_compiled_step(make_model(size), make_batch(size), torch.device(DEVICE), "bf16")
        compiled_fit = fit_compute(timed, base, fused_seconds=step.other_s)
        CALIBRATED["compiled"] = custom(
            f"calibrated-compiled-{base.name}", base=base,
            matmul_efficiency=compiled_fit.matmul_efficiency,
            pointwise_efficiency=compiled_fit.pointwise_efficiency)
    rows = []
    for label, ks in (("matmuls", [k for k in timed if k.flops > 0 and not is_attention(k)]),
                      ("attention", [k for k in timed if is_attention(k)]),  # (None: priced by rates)
                      ("other ops", [k for k in timed if k.flops <= 0])):
        priced = not (ks and is_attention(ks[0]) and base.attention_efficiency)
        rows.append({"kernels": label, "distinct": len(ks), "measured_ms": step_seconds(ks) * 1e3,
                     f"{base.name}_ms": step_seconds(ks, base) * 1e3 if priced else None,
                     "calibrated_ms": step_seconds(ks, topo) * 1e3 if priced else None})
    rows.append({"kernels": "fitted", "matmul_efficiency": fit.matmul_efficiency,
                 "pointwise_efficiency": fit.pointwise_efficiency, "held_at_1": fit.clamped,
                 "not_timed": [name for name, _ in failed]})
    if compiled_fit is not None:
        rows.append({"kernels": "compiled step outside GEMMs/attention", "distinct": step.kernels,
                     "measured_ms": step.other_s * 1e3, "matmul_ms": step.matmul_s * 1e3,
                     "pointwise_efficiency": compiled_fit.pointwise_efficiency})
    return rows


def _timed_steps(step: Callable[[], Any], opt: torch.optim.Optimizer, repeats: int) -> tuple[float, float]:
    """Median seconds of ``step`` (the optimizer's update outside the timing) and peak bytes."""
    for _ in range(3):
        step()
        opt.step()
        opt.zero_grad(set_to_none=False)
    _sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    peak = float(torch.cuda.max_memory_allocated()) if DEVICE == "cuda" else float("nan")
    return statistics.median(times), peak


# Kernel names by kind (autopar.calibrate's words; inductor's generated kernels start "triton_").
KERNEL_KINDS = (("triton (fused by inductor)", ("triton",)), ("attention", ATTENTION_KERNEL_WORDS),
                ("gemm", GEMM_KERNEL_WORDS))


def kernel_breakdown(step: Callable[[], Any], opt: torch.optim.Optimizer, steps: int = 3) -> dict:
    """The device time of ``step``'s kernels per step, by kind (``KERNEL_KINDS``, the rest as
    "other"), from PyTorch's profiler over ``steps`` steps; the error's text if it fails."""
    if DEVICE != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
                opt.zero_grad(set_to_none=False)
            _sync()
        out: dict[str, float] = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            name = e.key.lower()
            kind = next((k for k, keys in KERNEL_KINDS if any(w in name for w in keys)), "other")
            out[kind] = out.get(kind, 0.0) + t / 1e3 / steps
        return out
    except Exception as e:  # a measurement beside the step's: reported, the step still stands
        return {"error": f"{type(e).__name__}: {e}"}


def big_step(size: dict, mesh: autopar.Mesh, repeats: int) -> list[dict]:
    """Part 3: the compiled bf16 step of a 1B GPT, measured against the plan's prediction."""
    ids, tgt = _batch(size)
    rows = []
    t0 = time.perf_counter()
    pm = autopar.parallelize(make_model(size).to(DEVICE), mesh, (ids, tgt), compile=True, plan_cache=False,
                             config=autopar.Config(mixed_precision="bf16"))
    setup_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-5, foreach=True)
    measured, peak = _timed_steps(lambda: pm.step(ids, tgt), opt, repeats)
    kernel_ms = kernel_breakdown(lambda: pm.step(ids, tgt), opt)
    pred = pm.plan.predicted
    n_params = sum(p.numel() for p in pm.parameters())
    calibrated = {}
    for key, topo in CALIBRATED.items():  # the same model planned on part 3's topologies
        vmesh = autopar.Mesh.virtual(topo, nodes=1, gpus_per_node=1)
        calibrated[key] = autopar.plan(make_model(size), vmesh, make_batch(size), config=autopar.Config(
            mixed_precision="bf16")).predicted["step_time_s"]
    rows.append({"variant": "autopar (compiled)", "params": n_params, "measured_s": measured,
                 "predicted_s": pred["step_time_s"],
                 "predicted_s_calibrated": calibrated.get("topology"),
                 "predicted_s_calibrated_compiled": calibrated.get("compiled"),
                 "peak_GiB": peak / 2**30,
                 "predicted_peak_GiB": pred["peak_memory_bytes"] / 2**30, "setup_s": setup_s,
                 "techniques": dict(pm.plan.techniques),
                 "model_tflops": (pred.get("model_flops") or 0) / measured / 1e12,
                 "kernel_ms_per_step": kernel_ms})
    pm = opt = None  # (freed before the baseline's model is built)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    model = make_model(size).to(DEVICE)
    compiled = torch.compile(model)

    def eager_step() -> None:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = compiled(ids, tgt)
        loss.backward()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    measured, peak = _timed_steps(eager_step, opt, repeats)
    rows.append({"variant": "torch.compile", "params": n_params, "measured_s": measured,
                 "peak_GiB": peak / 2**30, "kernel_ms_per_step": kernel_breakdown(eager_step, opt)})
    return rows


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                    causal: bool) -> Attention:
    """Attention in float64 by its definition (softmax of the scaled scores, the causal mask
    aligned top-left as the kernels align it) and its gradients by autograd: the reference."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.softmax(scores, -1) @ v
    out.backward(grad.double())
    return Attention(out.detach(), lse.detach(), q.grad, k.grad, v.grad)


def _relative(got: Attention, ref: Attention) -> tuple[float, str]:
    """The largest error of any of the five results, relative to that result's largest value,
    and which result it is."""
    return max((float((getattr(got, f).double() - getattr(ref, f)).abs().max()
                      / getattr(ref, f).abs().max()), f) for f in ("out", "lse", "dq", "dk", "dv"))


def _attention_ops(dtype: torch.dtype) -> str:
    """The fused attention op PyTorch's dispatcher picks here for causal attention."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.randn(1, 4, 256, 64, device=DEVICE, dtype=dtype)
    g = make_fx(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True))(q)
    return ",".join(str(n.target) for n in g.graph.nodes if "attention" in str(n.target))


def cp_kernels() -> list[dict]:
    """Context parallelism's blocks with this device's kernels (``autopar.passes.cp_simulation``:
    2 and 4 cp ranks simulated in one process, each form and layout, causal or not): output,
    log-sum-exp and the three gradients against float64 attention, next to the same kernel
    run once on the whole sequence. A row passes when its error is at most three times the
    whole kernel's plus a floor (fp32 1e-5; bf16 8e-3, two roundings of 3.9e-3): the blocks
    round each block's result to the kernel's dtype before merging in float32, and the
    gathered form's key gradients are a sum of the ranks' shares."""
    from autopar.passes.cp_simulation import simulate, whole

    rows = [{"case": "dispatcher's causal op", "kernel": f"bf16: {_attention_ops(torch.bfloat16)}; "
             f"fp32: {_attention_ops(torch.float32)}"}]
    floor = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
    kernels = [("cudnn", torch.bfloat16), ("flash", torch.bfloat16), ("efficient", torch.float32),
               ("efficient", torch.bfloat16)]
    if DEVICE == "cpu":
        kernels = [("cpu", torch.float32)]
    torch.manual_seed(0)
    for kernel, dtype in kernels:
        q, k, v, grad = (torch.randn(2, 4, 512, 64, device=DEVICE, dtype=dtype) for _ in range(4))
        for causal in (True, False):
            ref = _math_attention(q, k, v, grad, causal)
            base = _relative(whole(kernel, q, k, v, grad, causal), ref)[0]
            for ranks in (2, 4):
                for form in ("ring", "gather"):
                    for balanced in (True, False):
                        err, worst = _relative(simulate(kernel, q, k, v, grad, ranks, form,
                                                        causal, balanced), ref)
                        rows.append({"kernel": kernel, "dtype": str(dtype)[6:], "causal": causal,
                                     "cp": ranks, "form": form, "balanced": balanced,
                                     "error": err, "worst": worst, "whole_kernel_error": base,
                                     "ok": err <= 3 * base + floor[dtype]})
    return rows + cp_timing()


def _attention_price(topo: Topology, call: Any, batch_heads: int, itemsize: int,
                     balanced: bool, rank: int) -> float:
    """The cost model's seconds for a causal attention call of ``batch_heads`` heads (torch's
    FLOP count): in blocks on a GPU preset (``gathered_seconds`` for ``rank``), else one
    kernel call (the CPU's, with its mask over every key)."""
    from autopar.cost_models.attention import attention_seconds, gathered_seconds

    flops = (4 if call.direction == "fwd" else 10) * batch_heads * call.s_q * call.s_k * call.head_dim
    dtype = "fp32" if topo.device_type == "cpu" else "bf16"

    def one(c: Any, f: float) -> float:
        return attention_seconds(c, f, 0.0, dtype, topo) or op_time(f, 0.0, topo, dtype, True)

    blocks = gathered_seconds(call, flops, batch_heads, itemsize, balanced, topo, one, rank)
    return one(call, flops) if blocks is None else blocks


def cp_timing(ranks: int = 4) -> list[dict]:
    """One cp rank's gathered-form attention (its queries against the whole keys in blocks,
    ``passes.attention_blocks``), forward and backward, and its block kernels alone, against
    the whole causal kernel and against the cost model's prices on this GPU's preset
    (``cost_models.attention.gathered_seconds``, for the rank measured): balanced rank 0, and
    the first and last of contiguous blocks."""
    from autopar.cost_models.attention import AttentionCall, gathered_calls
    from autopar.passes.attention_blocks import (block_backward, block_forward, forward_extras,
                                                 gathered_backward, gathered_forward)
    from autopar.sequence_layout import SequenceLayout, query_runs

    cpu = DEVICE == "cpu"
    kernel, dtype = ("cpu", torch.float32) if cpu else ("cudnn", torch.bfloat16)
    b, h, s, d = (1, 2, 256, 16) if cpu else (1, 16, 16384, 128)
    topo = get_preset("cpu-gloo" if cpu else preset_for())
    q, k, v, grad = (torch.randn(b, h, s, d, device=DEVICE, dtype=dtype) for _ in range(4))
    extra = forward_extras(kernel, q, k, v, True)
    out, lse = block_forward(kernel, q, k, v, True, None)

    def price(direction: str, s_q: int, balanced: bool, rank: int = 0) -> float:
        return _attention_price(topo, AttentionCall(direction, True, s_q, s, d), b * h,
                                q.element_size(), balanced, rank)

    rows = [{"case": "whole causal kernel", "kernel": f"{kernel} b{b} h{h} s{s} d{d}",
             "fwd_ms": cuda_time(lambda: block_forward(kernel, q, k, v, True, None), 7, 3) * 1e3,
             "bwd_ms": cuda_time(lambda: block_backward(kernel, grad, q, k, v, out, lse, True,
                                                        None, None, extra), 7, 3) * 1e3,
             "priced_ms": (price("fwd", s, False) + price("bwd", s, False)) * 1e3}]
    if not cpu:  # (FlashAttention's whole kernel, for comparison)
        fo, fl = block_forward("flash", q, k, v, True, None)
        fx = forward_extras("flash", q, k, v, True)
        rows.append({"case": "whole causal kernel", "kernel": f"flash b{b} h{h} s{s} d{d}",
                     "fwd_ms": cuda_time(lambda: block_forward("flash", q, k, v, True, None),
                                         7, 3) * 1e3,
                     "bwd_ms": cuda_time(lambda: block_backward("flash", grad, q, k, v, fo, fl,
                                                                True, None, None, fx), 7, 3) * 1e3})
    size = s // ranks
    for layout, rank in ((SequenceLayout(0, ranks), 0), (None, 0), (None, ranks - 1)):
        runs = query_runs(s, rank * size, size, layout)
        qr, gr = (torch.cat([x[..., p:p + c, :] for _, p, c in runs], 2).contiguous()
                  for x in (q, grad))
        o, l = gathered_forward(kernel, qr, k, v, True, None, runs)
        blocks = [(qr[..., r, :].contiguous(), k[..., ks, :].contiguous(),
                   v[..., ks, :].contiguous(), gr[..., r, :].contiguous(), c)
                  for r, ks, c in gathered_calls(runs, True, s)]
        outs = [block_forward(kernel, a, kk, vv, c, None) for a, kk, vv, _, c in blocks]

        def kernels_only() -> None:
            for (a, kk, vv, g, c), (ob, lb) in zip(blocks, outs):
                block_forward(kernel, a, kk, vv, c, None)
                block_backward(kernel, g, a, kk, vv, ob, lb, c, None, None, extra)

        balanced = layout is not None
        rows.append({
            "case": f"cp={ranks} rank {rank}, {'balanced' if balanced else 'contiguous'}",
            "kernel": f"{kernel} b{b} h{h} s{s} d{d}",
            "fwd_ms": cuda_time(lambda: gathered_forward(kernel, qr, k, v, True, None, runs),
                                7, 3) * 1e3,
            "bwd_ms": cuda_time(lambda: gathered_backward(kernel, gr, qr, k, v, o, l, True, None,
                                                          runs, extra), 7, 3) * 1e3,
            "kernels_ms": cuda_time(kernels_only, 7, 3) * 1e3,
            "priced_ms": (price("fwd", size, balanced, rank)
                          + price("bwd", size, balanced, rank)) * 1e3})
    return rows


def _part(results: dict, name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:  # recorded and reported: the part fails, the others still run
        results[name] = [{"ok": False, "error": traceback.format_exc(limit=-6)}]
    print(f"== {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(tabulate(results[name], headers="keys", floatfmt=".4g"), flush=True)


def _device_facts() -> dict[str, Any]:
    if DEVICE == "cpu":
        return {"device": "cpu", "preset": "cpu-gloo", "torch": torch.__version__}
    name = torch.cuda.get_device_name()
    props = torch.cuda.get_device_properties(0)
    return {"device": name, "preset": preset_for(), "torch": torch.__version__,
            "sms": props.multi_processor_count, "memory_GiB": props.total_memory / 2**30}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--quick", action="store_true", help="a 0.1B model in part 3 (for a first try)")
    p.add_argument("--parts", default="equivalence,kernels,calibration,step,cp_kernels")
    p.add_argument("--cpu", action="store_true",
                   help="the script's own smoke test: tiny sizes on the CPU (gloo), no figures")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; run it on a machine with a GPU (or --cpu).")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    one_rank_group()
    results = _device_facts()
    topo = results["preset"]
    mesh = autopar.Mesh.from_torchrun(topology=topo)
    print(results, flush=True)
    size = TINY if args.cpu else QUICK_B if args.quick else ONE_B
    parts = {"equivalence": lambda: equivalence(TINY if args.cpu else SMALL, mesh),
             "kernels": lambda: kernels(size, topo),
             "calibration": lambda: calibration(size, topo),
             "step": lambda: big_step(size, mesh, repeats=10),
             "cp_kernels": cp_kernels}
    for part in args.parts.split(","):
        _part(results, part, parts[part])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    dist.destroy_process_group()
    failed = [r for part in parts for r in results.get(part, []) if r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

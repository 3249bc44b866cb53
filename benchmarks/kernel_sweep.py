"""Kernel times by shape on one CUDA GPU: the data a shape-aware compute model is checked on.

    python benchmarks/kernel_sweep.py --json sweep.json [--budget-s 120] [--cpu]
    python benchmarks/kernel_sweep.py --report benchmarks/data/h200_kernel_sweep.json [--topology h200-dgx]

Times, with CUDA events, the kernels a transformer's training step runs, over the shapes that
tensor parallelism and the published model sizes produce:

- **GEMMs** in bf16 and fp32 (TF32 off): a layer's four weight GEMMs (QKV, attention output,
  MLP up and down) for hidden sizes 768-12288, 512-8192 tokens and the tensor-parallel splits
  1, 2, 4 and 8, in the forward layout (``x @ w.T``, as ``nn.Linear``); the two backward layouts
  (``dy @ w`` and ``dy.T @ x``) for the unsplit ones; LM heads of 32000, 32768 and 50257
  outputs (the last not a multiple of 8); thin GEMMs of 16-256 rows (the memory-bound regime).
- **attention**: ``scaled_dot_product_attention`` forward and backward in bf16, causal and not,
  head dims 64 and 128, sequences 512-8192 at a fixed 16K tokens.
- **memory-bound ops**: add, GELU, layer norm (forward), softmax, in bf16 and fp32, from 1 MiB
  to 1 GiB of input.

Each kernel is launched back to back enough times to fill about 2 ms between two events (so a
kernel shorter than its launch is timed as the GPU runs it in a step), median of 5 such batches
after 2 warm-ups; inputs smaller than the L2 cache stay in it, as the device facts say.
Nothing here is fitted: the rows are written as measured, each with its FLOPs and bytes as
:mod:`autopar.cost_models.compute` counts them. ``--budget-s`` stops the sweep (keeping what it
has; 60% of it for the GEMMs, 20% each for the rest) before the machine's time runs out;
``--cpu`` is the script's own smoke test at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from autopar.cost_models.calibration import LAUNCH_BOUND_S  # the launch-rate floor of the report

DEVICE = "cuda"
HIDDEN = (768, 1024, 1536, 2048, 2304, 2560, 3072, 4096, 5120, 6144, 8192, 12288)
TOKENS = (512, 2048, 8192)
SPLITS = (1, 2, 4, 8)


def batch_time(fn: Callable[[], Any], target_s: float = 2e-3, batches: int = 5) -> float:
    """Median seconds of one ``fn()`` when launched back to back (see the module's text)."""
    fn()
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(200, int(target_s / once)))
    times = []
    for _ in range(batches):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def gemm_shapes(hidden: tuple[int, ...], tokens: tuple[int, ...]) -> Iterator[dict]:
    """(m, k, n, layout, what) of the layer GEMMs, LM heads and thin GEMMs (module's text)."""
    for h in hidden:
        for t in tokens:
            for tp in SPLITS:
                if h % (tp * 64):
                    continue
                for what, k, n in (("qkv", h, 3 * h // tp), ("proj", h // tp, h),
                                   ("fc1", h, 4 * h // tp), ("fc2", 4 * h // tp, h)):
                    yield dict(m=t, k=k, n=n, layout="NT", what=what, tp=tp)
                    if tp == 1 and t == tokens[-1]:
                        yield dict(m=t, k=n, n=k, layout="NN", what=f"{what} dgrad", tp=tp)
                        yield dict(m=k, k=t, n=n, layout="TN", what=f"{what} wgrad", tp=tp)
    for vocab in (32000, 32768, 50257):
        for h in hidden[::3]:
            yield dict(m=tokens[-1], k=h, n=vocab, layout="NT", what="lm head", tp=1)
    for m in (16, 64, 256):
        for h in hidden[1::3]:
            yield dict(m=m, k=h, n=4 * h, layout="NT", what="thin", tp=1)


def _gemm(m: int, k: int, n: int, layout: str, dtype: torch.dtype) -> Callable[[], Any]:
    """``fn`` computing an (m, n) product over k in ``layout`` (N: as stored, T: transposed)."""
    a = torch.randn((k, m) if layout[0] == "T" else (m, k), device=DEVICE, dtype=dtype)
    b = torch.randn((n, k) if layout[1] == "T" else (k, n), device=DEVICE, dtype=dtype)
    a = a.t() if layout[0] == "T" else a
    b = b.t() if layout[1] == "T" else b
    return lambda: a @ b


def gemms(budget_end: float, hidden: tuple[int, ...], tokens: tuple[int, ...]) -> list[dict]:
    """The GEMMs of :func:`gemm_shapes` timed in bf16 (every layout) and fp32 (the forward's),
    until ``budget_end`` (``time.perf_counter``)."""
    rows = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for s in gemm_shapes(hidden, tokens):
            if time.perf_counter() > budget_end:
                return rows
            if name == "fp32" and s["layout"] != "NT":
                continue
            elt = torch.finfo(dtype).bits // 8
            seconds = batch_time(_gemm(s["m"], s["k"], s["n"], s["layout"], dtype))
            rows.append(dict(kind="gemm", dtype=name, **s, seconds=seconds,
                             flops=2 * s["m"] * s["k"] * s["n"],
                             bytes=(s["m"] * s["k"] + s["k"] * s["n"] + s["m"] * s["n"]) * elt))
    return rows


def attention(budget_end: float, tokens: int, seqs: tuple[int, ...]) -> list[dict]:
    """SDPA forward and backward, bf16; FLOPs without the causal discount (as the cost model
    counts them: ``4 b h s^2 d`` forward, 2.5 times that backward)."""
    rows = []
    for d in (64, 128):
        heads = 2048 // d if DEVICE == "cuda" else 2
        for s in seqs:
            for causal in (True, False):
                if time.perf_counter() > budget_end:
                    return rows
                b = max(1, tokens // s)
                q, k, v = (torch.randn(b, heads, s, d, device=DEVICE, dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                grad = torch.randn_like(out)
                flops = 4 * b * heads * s * s * d
                io = 4 * q.numel() * 2
                for direction, fn, f in (
                        ("fwd", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), flops),
                        ("bwd", lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                         2.5 * flops)):
                    rows.append(dict(kind="sdpa", dtype="bf16", direction=direction, batch=b,
                                     heads=heads, seq=s, head_dim=d, causal=causal,
                                     seconds=batch_time(fn), flops=f,
                                     bytes=io if direction == "fwd" else 2 * io))
    return rows


def memory_bound(budget_end: float, sizes: tuple[int, ...]) -> list[dict]:
    """add, GELU, layer norm and softmax over rows of 4096, bytes = inputs read + output
    written."""
    rows = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        elt = torch.finfo(dtype).bits // 8
        for size in sizes:
            n = size // elt
            x = torch.randn(n // 4096, 4096, device=DEVICE, dtype=dtype)
            y = torch.randn_like(x)
            w = torch.ones(4096, device=DEVICE, dtype=dtype)
            for op, fn, moved in (("add", lambda: x + y, 3 * n * elt),
                                  ("gelu", lambda: F.gelu(x), 2 * n * elt),
                                  ("layer_norm", lambda: F.layer_norm(x, (4096,), w, w), 2 * n * elt),
                                  ("softmax", lambda: torch.softmax(x, -1), 2 * n * elt)):
                if time.perf_counter() > budget_end:
                    return rows
                rows.append(dict(kind="pointwise", op=op, dtype=name, numel=n, seconds=batch_time(fn),
                                 flops=0, bytes=moved))
    return rows


def facts() -> dict[str, Any]:
    """The device, torch, SM count, L2 and memory of the GPU (or the CPU smoke test's)."""
    if DEVICE == "cpu":
        return {"device": "cpu", "torch": torch.__version__}
    p = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "sms": p.multi_processor_count, "l2_bytes": getattr(p, "L2_cache_size", None),
            "memory_GiB": p.total_memory / 2**30, "tf32": torch.backends.cuda.matmul.allow_tf32,
            "date": time.strftime("%Y-%m-%d")}


# ------------------------------------------------------------------------------------------
# the report: a sweep's rows against the cost model (no GPU needed)



def predicted(row: dict, topo: Any) -> float:
    """The cost model's seconds for one row (:func:`autopar.cost_models.compute.op_time`; a
    GEMM's peak by :func:`~autopar.cost_models.compute.matmul_peak` on its operands' layout;
    attention by :func:`~autopar.cost_models.attention.attention_seconds` where the topology
    has measured rates, which for a preset's own sweep reproduces its rows by construction)."""
    from autopar.cost_models.attention import AttentionCall, attention_seconds
    from autopar.cost_models.compute import matmul_peak, op_time

    if row["kind"] == "gemm":
        dtype = torch.bfloat16 if row["dtype"] == "bf16" else torch.float32
        m, k, n, layout = row["m"], row["k"], row["n"], row["layout"]
        a = torch.empty((k, m) if layout[0] == "T" else (m, k), device="meta", dtype=dtype)
        b = torch.empty((n, k) if layout[1] == "T" else (k, n), device="meta", dtype=dtype)
        a, b = (a.t() if layout[0] == "T" else a), (b.t() if layout[1] == "T" else b)
        peak = matmul_peak(torch.ops.aten.mm.default, [a, b, torch.empty(m, n, device="meta", dtype=dtype)])
        return op_time(row["flops"], row["bytes"], topo, peak)
    if row["kind"] == "sdpa":  # at the topology's measured attention rates, if it has them
        call = AttentionCall(row["direction"], row["causal"], row["seq"], row["seq"], row["head_dim"])
        fused = attention_seconds(call, row["flops"], row["bytes"], "bf16", topo)
        return op_time(row["flops"], row["bytes"], topo, "bf16") if fused is None else fused
    return op_time(0, row["bytes"], topo, row["dtype"], is_matmul=False)


def _waves(row: dict, topo: Any, tile: tuple[int, int], sms: int) -> float:
    """A GEMM priced by whole waves of ``tile`` output tiles over ``sms`` SMs (the quantisation
    of NVIDIA's GEMM performance guide), the memory term as :func:`predicted`'s."""
    import math

    tiles = math.ceil(row["m"] / tile[0]) * math.ceil(row["n"] / tile[1])
    flops = 2 * row["k"] * tile[0] * tile[1] * sms * math.ceil(tiles / sms)
    return max(predicted(dict(row, flops=flops), topo), predicted(dict(row, flops=0), topo))


def _spread(ratios: list[float]) -> list[Any]:
    """n, median, p10, p90 of measured / predicted, and the median and p90 |error| left after
    the one scale that centres them (the shape dependence a single efficiency cannot absorb)."""
    import math

    q = sorted(ratios)
    n, med = len(q), statistics.median(q)
    dev = sorted(abs(math.log(x / med)) for x in q)
    return [n, med, q[n // 10], q[-1 - n // 10], math.exp(dev[n // 2]) - 1,
            math.exp(dev[int(0.9 * (n - 1))]) - 1]


def report(path: str, topology: str) -> str:
    """Tables of a sweep's rows against the cost model on ``topology`` (module's text)."""
    from tabulate import tabulate

    from autopar.cost_models.topology import load_topology

    topo = load_topology(topology)
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    sms = data["facts"].get("sms") or 132
    groups: dict[str, list[float]] = {}

    def add(label: str, row: dict, pred: float) -> None:
        groups.setdefault(label, []).append(row["seconds"] / pred)

    for r in rows:
        if r["kind"] == "gemm":
            if r["seconds"] < LAUNCH_BOUND_S:
                add(f"gemm {r['dtype']}, launch-bound (< {LAUNCH_BOUND_S * 1e6:.0f} us)", r, predicted(r, topo))
                continue
            aligned = r["n"] % 8 == 0 and r["k"] % 8 == 0 and r["m"] % 8 == 0
            label = f"gemm {r['dtype']}" + ("" if aligned else " unaligned (a dim not a multiple of 8)")
            add(label, r, predicted(r, topo))
            if aligned:
                for tile in ((128, 128), (128, 256)):
                    add(f"gemm {r['dtype']}, priced by {tile[0]}x{tile[1]} tile waves", r,
                        _waves(r, topo, tile, sms))
        elif r["kind"] == "sdpa":
            add(f"sdpa {r['direction']} {'causal' if r['causal'] else 'full'} d{r['head_dim']}", r,
                predicted(r, topo))
        else:
            big = r["bytes"] > 4 * (data["facts"].get("l2_bytes") or 0)
            add(f"{r['op']} {r['dtype']}{'' if big else ' (in L2)'}", r, predicted(r, topo))
    table = [[label, *_spread(ratios)] for label, ratios in groups.items()]
    return (f"{data['facts']}\nmeasured / predicted on {topo.name}\n"
            + tabulate(table, headers=["kernels", "n", "median", "p10", "p90", "|err| median after scale",
                                       "|err| p90 after scale"], floatfmt=".3f"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--report", metavar="SWEEP", help="print a sweep's rows against the cost model "
                   "(no GPU needed) instead of measuring")
    p.add_argument("--topology", default="h200-dgx", help="the topology --report prices on")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop after this many seconds")
    p.add_argument("--cpu", action="store_true", help="smoke test: tiny sizes on the CPU")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.report, args.topology))
        return 0
    if not args.json:
        p.error("give --json (where to write the rows) or --report")
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("kernel_sweep: no CUDA device is visible; run it on a machine with a GPU (or --cpu).")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, Any] = {"facts": facts(), "rows": []}
    small = args.cpu
    # each part's own share of the budget, so a slow first part cannot starve the others
    parts = (
        ("gemm", lambda end: gemms(end, (128, 256) if small else HIDDEN, (64,) if small else TOKENS)),
        ("sdpa", lambda end: attention(end, 256 if small else 16384, (64, 128) if small else
                                   (512, 1024, 2048, 4096, 8192))),
        ("pointwise", lambda end: memory_bound(end, (2**16,) if small else
                                           tuple(2**e for e in range(20, 31, 2)))),
    )
    for (name, part), share in zip(parts, (0.6, 0.2, 0.2)):
        t0 = time.perf_counter()
        rows = part(t0 + share * args.budget_s)
        out["rows"] += rows
        print(f"{name}: {len(rows)} rows, {time.perf_counter() - t0:.1f} s", flush=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibrate a hardware topology on this machine: ``python -m autopar calibrate --out my.json``.

Starts one process per device (``nproc``: the GPUs present, or 2 CPU processes on gloo), which
time, all at once as a training job's ranks would:

1. **kernels**: every distinct operator of the user's model's joint forward+backward graph
   (``--model``; as captured for planning, whole tensors on one device), each called on inputs of
   its traced shapes, plus a reference GEMM in fp32 and bf16 and a streaming add; with
   ``--compiled`` (CUDA), also the model's step under ``torch.compile``, its kernel time split by
   PyTorch's profiler into GEMM and attention kernels and the rest (inductor's fused kernels,
   copies, fills), on which the pointwise efficiency is then fitted;
2. **collectives** (``nproc > 1``): all-reduce, all-gather, reduce-scatter, all-to-all and
   send/recv over all the processes, at message sizes from 4 bytes up.

:mod:`autopar.cost_models.calibration` then fits the topology's compute efficiencies (and, on a
CPU, its peaks and bandwidth: measured) and its link constants, and the result is written as a
topology JSON that ``Mesh.virtual("my.json")``, ``Mesh.from_torchrun(topology="my.json")`` and
``python -m autopar plan --hardware my.json`` take. The inter-node link cannot be measured on one
machine: a GPU topology keeps its base preset's, a CPU one (one "node") uses the measured link.

    result = calibrate("benchmarks.runtime_vs_torch:calibration_model", batch=8, seq=128)
    result.topology.to_dict()
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar._torch_private import FakeTensor, OpOverload, tree_map_only
from autopar.cost_models.calibration import (
    CollectiveSample, ComputeFit, KernelSample, fit_compute, fit_link,
)
from autopar.cost_models.topology import Topology, custom, get_preset

__all__ = ["CalibrationResult", "CompiledStep", "ATTENTION_KERNEL_WORDS", "GEMM_KERNEL_WORDS",
           "MATMUL_KERNEL_WORDS", "calibrate", "model_kernels",
           "time_kernels", "time_compiled_step", "materialize", "base_preset_for", "free_port", "report"]

_CPU_SIZES = (2**2, 2**8, 2**12, 2**16, 2**18, 2**20, 2**22, 2**24)
_GPU_SIZES = (2**2, 2**12, 2**16, 2**20, 2**24, 2**27, 2**30)
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class CalibrationResult:
    """What :func:`calibrate` measured and fitted.

    ``topology``: the calibrated topology; ``base``: the preset it started from; ``kernels`` (the
    model's operators), ``reference`` (the reference GEMMs and streaming add) and
    ``collectives``: the timings (seconds of one call, the mean over the processes of each one's
    median); ``fit``: the compute constants; ``failed``: kernels that could not be run on
    synthetic inputs (name and error), left out of the fit.
    """

    topology: Topology
    base: Topology
    kernels: tuple[KernelSample, ...]
    reference: tuple[KernelSample, ...]
    collectives: tuple[CollectiveSample, ...]
    fit: ComputeFit
    failed: tuple[tuple[str, str], ...]
    compiled: "CompiledStep | None" = None

    def timings(self) -> dict[str, Any]:
        """Every timing as plain JSON (``--timings``): to inspect the fit or refit it with
        :func:`autopar.cost_models.calibration.fit_compute` and ``fit_link``."""
        return {"kernels": [k.__dict__ for k in self.kernels],
                "reference": [k.__dict__ for k in self.reference],
                "collectives": [c.__dict__ for c in self.collectives],
                "failed": [list(f) for f in self.failed], "topology": self.topology.to_dict(),
                "compiled": None if self.compiled is None else self.compiled.__dict__}


@dataclass(frozen=True)
class CompiledStep:
    """Device seconds of one compiled forward and backward step, by kernel kind: GEMM and
    attention kernels (``matmul_s``) and every other kernel (``other_s``); ``kernels``: the
    distinct kernels the profiler saw."""

    matmul_s: float
    other_s: float
    kernels: int


# GEMM and attention kernels by name, as cuBLAS (``nvjet``, ``sm90_xmma_gemm``), CUTLASS, cuDNN
# and the flash kernels call them on NVIDIA GPUs; every other kernel is inductor's or a copy
GEMM_KERNEL_WORDS = ("gemm", "nvjet", "xmma", "cutlass")
ATTENTION_KERNEL_WORDS = ("flash", "fmha", "attention", "cudnn")
MATMUL_KERNEL_WORDS = GEMM_KERNEL_WORDS + ATTENTION_KERNEL_WORDS


def base_preset_for(device: str) -> str:
    """The preset a calibration on ``device`` ("cpu" or "cuda") starts from: ``cpu-gloo``, or
    the preset of this GPU's kind (A100, H100, H200); ``ValueError`` for another GPU (pass
    ``base=``)."""
    if device == "cpu":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(0)
    for key, preset in (("H200", "h200-dgx"), ("H100", "h100-dgx"), ("A100", "a100-dgx")):
        if key in name:
            return preset
    raise ValueError(f"no preset for the GPU {name!r}; pass base= (a preset whose datasheet peaks "
                     f"are this GPU's; see autopar.cost_models.register_topology)")


# ------------------------------------------------------------------------------------------
# kernels of a model


def model_kernels(model: torch.nn.Module, inputs: Any, mixed_precision: str | None = None
                  ) -> list[tuple[KernelSample, fx.Node]]:
    """The distinct operators of ``model``'s joint graph (as :func:`autopar.capture.capture`
    traces it), each as a :class:`KernelSample` without a time (its roofline terms on whole
    tensors, how many nodes of the graph run it, and its bytes where a compiler fuses it) and
    one node to run it from. View-like ops
    (free in the cost model) and expert ops (priced apart) are left out."""
    from autopar.capture import capture
    from autopar.cost_models.node_compute import is_free, roofline_terms
    from autopar.cost_models.sharding import fused_edges
    from autopar.strategies.rules import EXPERT_OPS

    traced = capture(model, inputs, mixed_precision)
    fusion = fused_edges(traced)
    found: dict[tuple, list] = {}
    for n in traced.gm.graph.nodes:
        if n.op != "call_function" or is_free(n) or n.target in EXPERT_OPS \
                or not isinstance(n.target, OpOverload):
            continue
        key = (str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), _signature)))
        fused = roofline_terms(n, fused=fusion.get(n.name, frozenset()))[1]
        if key in found:
            found[key][1] += 1
            found[key][3] += fused
            continue
        flops, nbytes, dtype = roofline_terms(n)
        found[key] = [KernelSample(str(n.target), flops, nbytes, dtype, 0.0), 1, n, fused]
    return [(replace(k, count=c, fused_bytes=f / c), n) for k, c, n, f in found.values()]


def _signature(a: fx.Node) -> Any:
    v = a.meta.get("val")
    return (tuple(v.shape), tuple(v.stride()), str(v.dtype)) if isinstance(v, torch.Tensor) else a.name


def _real(value: Any, device: torch.device) -> Any:
    """A real tensor of ``value``'s shape, strides and dtype (random floats, zero integers: valid
    indices), or ``value`` itself when it is no tensor."""
    if isinstance(value, torch.Tensor):
        t = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype,
                                device=device)
        return t.normal_() if t.is_floating_point() else t.zero_()
    if isinstance(value, (list, tuple)):
        return type(value)(_real(v, device) for v in value)
    return value


def _call_of(n: fx.Node, device: torch.device) -> Callable[[], Any]:
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: _real(a.meta.get("val"), device))
    # a device the trace named (a factory op's or a copy's) is the timing device: a copy traced
    # as "to cpu" would otherwise time a device-to-host transfer
    args, kwargs = tree_map_only(torch.device, lambda _: device, (args, kwargs))
    target = n.target
    return lambda: target(*args, **kwargs)


# ------------------------------------------------------------------------------------------
# timing (every process runs the same calls at once)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, reps: int, active: bool = True) -> float:
    """The median seconds of ``fn()`` over ``reps`` calls after one warm-up, every process
    starting together; the mean over the ``active`` processes (one with no part in the call,
    as an odd rank out of send/recv pairs, still runs ``fn`` and its barriers)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    out = torch.tensor([statistics.median(times) if active else 0.0, float(active)],
                       dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(out)
    return float(out[0].item() / out[1].item())


def _all_ran(ok: bool, device: torch.device) -> bool:
    """Whether every process could run a call (so all of them time it or none: a process that
    skipped it alone would pair its next collectives with the wrong calls)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def _reference_kernels(device: torch.device, quick: bool) -> list[tuple[KernelSample, Callable]]:
    """A square GEMM in fp32 and bf16 (the best rates a CPU's peaks are taken from) and a
    streaming add (its bandwidth)."""
    out = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        # (a CPU without bf16 GEMM units runs bf16 about 50x slower: a smaller one there)
        size = 8192 if device.type == "cuda" else (512 if quick else 1024) // (4 if name == "bf16" else 1)
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        out.append((KernelSample(f"reference mm {size}^3 {name}", 2.0 * size**3,
                                 3.0 * size * size * a.element_size(), name, 0.0),
                    lambda a=a, b=b: a @ b))
    numel = (4 if quick else 16) * 2**20 if device.type == "cpu" else 2**28
    x, y = (torch.randn(numel, device=device) for _ in range(2))
    out.append((KernelSample(f"reference add {numel}", 0.0, 12.0 * numel, "fp32", 0.0),
                lambda: x + y))
    return out


def _collective(kind: str, nbytes: int, device: torch.device
                ) -> tuple[Callable[[], Any], int, bool]:
    """Collective ``kind`` of about ``nbytes`` over every process: the call, the bytes it moves
    as :mod:`autopar.cost_models.comm` counts them (the whole buffer: a multiple of 4 bytes
    times the processes), and whether this process takes part (send/recv pairs ranks 0-1,
    2-3, ...; a last odd rank sits out)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = max(nbytes // 4, n)
    full = torch.zeros(numel - numel % n, device=device)
    part = torch.zeros(full.numel() // n, device=device)
    size = 4 * full.numel()
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full)), size, True
    if kind == "all_gather":
        return (lambda: dist.all_gather_into_tensor(full, part)), size, True
    if kind == "reduce_scatter":
        return (lambda: dist.reduce_scatter_tensor(part, full)), size, True
    if kind == "all_to_all":
        other = torch.zeros_like(full)
        return (lambda: dist.all_to_all_single(other, full)), size, True
    peer = rank ^ 1  # even ranks send, odd ones receive
    if peer >= n:
        return (lambda: None), size, False
    send = rank % 2 == 0
    return (lambda: dist.send(full, peer)) if send else (lambda: dist.recv(full, peer)), size, True


# ------------------------------------------------------------------------------------------
# the processes


@dataclass(frozen=True)
class _Job:
    model: str | None
    batch: int
    seq: int
    mixed_precision: str | None
    quick: bool
    out: str
    compiled: bool = False


def _worker(rank: int, nproc: int, port: int, job: _Job, use_cuda: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
    if use_cuda:
        torch.cuda.set_device(rank)
    else:  # as torchrun runs them: one thread each unless OMP_NUM_THREADS says otherwise
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1 if nproc > 1 else
                                                 torch.get_num_threads())))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        reps = 3 if job.quick else 7
        record: dict[str, Any] = {"kernels": [], "reference": [], "collectives": [], "failed": []}
        with torch.no_grad():
            for k, fn in _reference_kernels(device, job.quick):
                record["reference"].append(replace(k, seconds=_time(fn, device, reps)).__dict__)
        if job.model is not None:  # (captured with autograd on: the joint graph)
            _time_model(job, device, reps, record)
        if nproc > 1:
            sizes = _GPU_SIZES if use_cuda else _CPU_SIZES
            for kind in _KINDS:
                for nbytes in sizes[::2] if job.quick else sizes:
                    fn, size, active = _collective(kind, nbytes, device)
                    t = _time(fn, device, reps, active)
                    ranks = 2 if kind == "send_recv" else nproc
                    record["collectives"].append(CollectiveSample(kind, size, ranks, t).__dict__)
        if rank == 0:
            Path(job.out).write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _time_model(job: _Job, device: torch.device, reps: int, record: dict) -> None:
    from autopar.model_presets import load_model

    with device:  # built on the device (a preset's fake tensors cannot be moved there after)
        model, inputs = load_model(job.model, job.batch, job.seq)
    kernels, failed = time_kernels(model, inputs, device, reps, job.mixed_precision)
    record["kernels"] += [k.__dict__ for k in kernels]
    record["failed"] += failed
    if job.compiled:  # a fresh copy: the one traced and timed op by op is not compiled again
        del model, inputs
        with device:
            model, inputs = load_model(job.model, job.batch, job.seq)
        record["compiled"] = time_compiled_step(model, inputs, device, job.mixed_precision).__dict__


def time_kernels(model: torch.nn.Module, inputs: Any, device: torch.device, reps: int = 7,
                 mixed_precision: str | None = None
                 ) -> tuple[list[KernelSample], list[tuple[str, str]]]:
    """Every distinct operator of ``model``'s joint graph (:func:`model_kernels`) timed on
    ``device`` (inputs of its traced shapes; every process of the default group at once, the
    mean of their medians over ``reps`` calls), and the operators synthetic inputs could not run
    (name, error), which are left out. ``model`` is moved to ``device`` (in place) and traced
    there. Needs a process group (one rank is enough)."""
    # traced on the device it is timed on: its kernels (CUDA's attention, not the CPU one) and
    # its autocast policy (CUDA runs layer norm in fp32, the CPU in bf16)
    if any(t.device != device for t in (*model.parameters(), *model.buffers())):
        model = model.to(device)
    inputs = tree_map_only(torch.Tensor, lambda t: t.to(device), inputs)
    timed, failed = [], []
    for k, node in model_kernels(model, inputs, mixed_precision):
        error = ""
        with torch.no_grad():
            try:
                fn = _call_of(node, device)
                fn()
                _sync(device)  # (a CUDA error surfaces here)
            except Exception as e:  # an op synthetic inputs cannot run: reported, not fitted
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if not _all_ran(not error, device):
                failed.append((k.name, error or "failed on another process"))
                continue
            timed.append(replace(k, seconds=_time(fn, device, reps)))
    return timed, failed


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give ``model`` real tensors on ``device`` in place of fake ones (a preset is built under
    ``FakeTensorMode``: a compiled program run on those reads memory that was never allocated):
    parameters drawn from N(0, 0.02), buffers as :func:`_real` makes them; real ones are moved.
    A parameter shared by several modules (tied embeddings) stays one parameter."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in made:
                module._parameters[name] = made[id(p)]
            elif p is not None and (isinstance(p, FakeTensor) or p.is_meta or p.device != device):
                fake = isinstance(p, FakeTensor) or p.is_meta
                real = _real(p, device).mul_(0.02) if fake else p.detach().to(device)
                made[id(p)] = module._parameters[name] = torch.nn.Parameter(
                    real, requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and (isinstance(b, FakeTensor) or b.is_meta or b.device != device):
                fake = isinstance(b, FakeTensor) or b.is_meta
                module._buffers[name] = _real(b, device) if fake else b.to(device)


def time_compiled_step(model: torch.nn.Module, inputs: Any, device: torch.device,
                       mixed_precision: str | None = None, steps: int = 3) -> CompiledStep:
    """``model``'s forward and backward under ``torch.compile`` on the CUDA ``device`` (moved
    there in place), the device time of its kernels per step by kind (:class:`CompiledStep`,
    :data:`MATMUL_KERNEL_WORDS`) over ``steps`` profiled steps after three warm-ups; every
    process of the default group at once, the mean over them. Raises ``ValueError`` on a CPU
    (its compiled kernels carry no such names)."""
    from torch.profiler import ProfilerActivity, profile

    from autopar.capture.joint import LossModule

    if device.type != "cuda":
        raise ValueError(f"time_compiled_step times CUDA kernels; got device {device}")
    materialize(model, device)
    inputs = tree_map_only(torch.Tensor, lambda t: _real(t, device) if isinstance(t, FakeTensor)
                           or t.is_meta else t.to(device), inputs)
    compiled = torch.compile(LossModule(model, torch.bfloat16 if mixed_precision == "bf16" else None))

    def step() -> None:
        if isinstance(inputs, dict):
            loss = compiled(**inputs)
        else:
            loss = compiled(*inputs) if isinstance(inputs, (tuple, list)) else compiled(inputs)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    _sync(device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    matmul = other = 0.0
    events = [e for e in prof.key_averages() if e.device_time_total > 0]  # (kernels, copies)
    for e in events:
        seconds = e.device_time_total * 1e-6 / steps
        name = e.key.lower()
        # (inductor's kernels are named after the ops they fuse: "triton_..._attention_" is one)
        if not name.startswith("triton") and any(w in name for w in MATMUL_KERNEL_WORDS):
            matmul += seconds
        else:
            other += seconds
    out = torch.tensor([matmul, other], dtype=torch.float64, device=device)
    dist.all_reduce(out)
    n = dist.get_world_size()
    return CompiledStep(float(out[0]) / n, float(out[1]) / n, len(events))


def free_port() -> int:
    """A free TCP port on this machine's loopback (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(model: str | None = None, batch: int = 8, seq: int = 128, nproc: int | None = None,
              base: str | None = None, name: str | None = None,
              mixed_precision: str | None = None, quick: bool = False,
              progress: Callable[[str], None] | None = None,
              compiled: bool = False) -> CalibrationResult:
    """Time kernels and collectives on this machine and fit a topology (see the module's text).

    ``model``: ``module:function`` or a preset name (as ``python -m autopar plan`` takes it),
    built with ``batch`` and ``seq``, whose operators are timed; ``None`` times the reference
    kernels alone. ``nproc``: processes (default: the GPUs present, or 2 CPU processes).
    ``base``: the preset whose datasheet figures a GPU keeps (default: by the GPU's name).
    ``quick``: fewer repetitions and sizes (a smoke test; noisier). ``compiled``: fit the
    pointwise efficiency on the model's compiled step (:func:`time_compiled_step`; CUDA and a
    model needed), for programs that train with ``compile=True``.
    """
    import torch.multiprocessing as mp

    say = progress or (lambda msg: None)
    use_cuda = torch.cuda.is_available()
    nproc = nproc or (torch.cuda.device_count() if use_cuda else 2)
    if nproc < 1 or (use_cuda and nproc > torch.cuda.device_count()):
        raise ValueError(f"calibrate: nproc={nproc}; give 1 to the number of GPUs "
                         f"({torch.cuda.device_count() if use_cuda else 'any, on CPU'})")
    if compiled and (not use_cuda or model is None):
        raise ValueError(f"calibrate: compiled=True times a model's compiled kernels on CUDA; got "
                         f"model={model!r} on {'CUDA' if use_cuda else 'a CPU'}: give a model and "
                         f"run it on a GPU, or leave compiled off")
    base_topo = get_preset(base or base_preset_for("cuda" if use_cuda else "cpu"))
    job = _Job(model, batch, seq, mixed_precision, quick, "", compiled)
    with tempfile.TemporaryDirectory() as tmp:
        job = replace(job, out=str(Path(tmp) / "timings.json"))
        say(f"timing on {nproc} {'GPU' if use_cuda else 'CPU'} process(es)"
            f"{f', the operators of {model}' if model else ''}")
        mp.spawn(_worker, args=(nproc, free_port(), job, use_cuda), nprocs=nproc, join=True)
        record = json.loads(Path(job.out).read_text())
    return _fit(record, base_topo, nproc, use_cuda, name, model)


def _fit(record: dict, base: Topology, nproc: int, use_cuda: bool, name: str | None,
         model: str | None) -> CalibrationResult:
    reference = [KernelSample(**k) for k in record["reference"]]
    kernels = [KernelSample(**k) for k in record["kernels"]]
    collectives = tuple(CollectiveSample(**c) for c in record["collectives"])
    compiled = CompiledStep(**record["compiled"]) if record.get("compiled") else None
    peaks = bandwidth = None
    if not use_cuda:  # no datasheet: the best rates measured (reference GEMMs or the model's)
        rates: dict[str, float] = {}
        for k in reference + kernels:
            if k.flops > 0:
                rates[k.dtype] = max(rates.get(k.dtype, 0.0), k.flops / k.seconds)
        peaks = rates
        # the streaming add's rate, or the model's own ops' when they beat it (in cache)
        streams = ([k for k in kernels if k.flops <= 0]
                   or [k for k in reference if k.flops <= 0])
        bandwidth = max([k.bytes / k.seconds for k in reference if k.flops <= 0]
                        + [sum(k.bytes * k.count for k in streams)
                           / sum(k.seconds * k.count for k in streams)])
    fit = fit_compute(kernels or reference, base, peaks, bandwidth,
                      fused_seconds=compiled.other_s if compiled else None)
    fields: dict[str, Any] = dict(peak_flops=fit.peak_flops, mem_bandwidth_Bps=fit.mem_bandwidth_Bps,
                                  matmul_efficiency=fit.matmul_efficiency,
                                  pointwise_efficiency=fit.pointwise_efficiency)
    if collectives:
        link = fit_link(collectives)
        fields["intra_node"] = link
        if not use_cuda:  # one machine, one "node": every axis uses the measured link
            fields["inter_node"] = link
    if not use_cuda:
        fields["gpus_per_node"] = nproc
        fields["memory_bytes"] = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / nproc
    device = torch.cuda.get_device_name(0) if use_cuda else f"CPU ({os.cpu_count()} cores)"
    notes = (f"calibrated {time.strftime('%Y-%m-%d')} on {device}, {nproc} process(es), torch "
             f"{torch.__version__}: {len(kernels)} operators of {model or 'no model'} and "
             f"{len(reference)} reference kernels timed, {len(collectives)} collectives"
             f"{'; pointwise fitted on the compiled step' if compiled else ''}; from "
             f"{base.name}" + (f"; held at 1: {', '.join(fit.clamped)}" if fit.clamped else ""))
    topo = custom(name or f"calibrated-{base.name}", base=base, notes=notes, **fields)
    return CalibrationResult(topo, base, tuple(kernels), tuple(reference), collectives, fit,
                             tuple(tuple(f) for f in record["failed"]), compiled)


def report(result: CalibrationResult) -> str:
    """A table of the fit: per kind of kernel and per collective, measured against the
    calibrated topology's prediction and the base preset's."""
    from tabulate import tabulate

    from autopar.cost_models.calibration import LAUNCH_BOUND_S, is_attention, step_seconds
    from autopar.cost_models.comm import collective_time

    rows = []
    groups = {"matmuls": [k for k in result.kernels if k.flops > 0 and not is_attention(k)],
              "attention": [k for k in result.kernels if is_attention(k)],
              "other ops": [k for k in result.kernels if k.flops <= 0],
              "reference": list(result.reference)}
    for label, ks in groups.items():
        if ks:  # (attention on a topology with measured rates: not priced sample by sample)
            rows.append([label, len(ks), step_seconds(ks) * 1e3, *(
                float("nan") if label == "attention" and t.attention_efficiency
                else step_seconds(ks, t) * 1e3 for t in (result.topology, result.base))])
    if result.compiled is not None:  # what the pointwise efficiency was fitted on
        ops = [replace(k, bytes=k.bytes if k.fused_bytes is None else k.fused_bytes)
               for k in result.kernels if k.flops <= 0]
        rows.append(["compiled step: kernels outside GEMMs and attention", result.compiled.kernels,
                     result.compiled.other_s * 1e3,
                     *(step_seconds(ops, t) * 1e3 for t in (result.topology, result.base))])
    for c in _few(result.collectives):
        rows.append([f"{c.kind} {c.nbytes:,} B", c.ranks, c.seconds * 1e3,
                     *(collective_time(c.kind, c.nbytes, c.ranks, t.intra_node) * 1e3
                       for t in (result.topology, result.base))])
    table = tabulate(rows, headers=["what", "kernels / ranks", "measured ms", "calibrated ms",
                                    f"{result.base.name} ms"], floatfmt=".3f")
    short = [k for k in result.kernels if k.seconds < LAUNCH_BOUND_S]
    if result.topology.device_type == "cuda" and short:
        share = step_seconds(short) / max(step_seconds(result.kernels), 1e-30)
        table += (f"\n{len(short)} of {len(result.kernels)} operators ({share:.0%} of the measured "
                  f"time) ran under {LAUNCH_BOUND_S * 1e6:.0f} us a call: launch-bound, their time "
                  f"is the host's, not the GPU's; calibrate with the batch and sequence you train with")
    return table


def _few(samples: Sequence[CollectiveSample]) -> list[CollectiveSample]:
    """The smallest and the largest message of each kind."""
    out = []
    for kind in dict.fromkeys(s.kind for s in samples):
        of = sorted((s for s in samples if s.kind == kind), key=lambda s: s.nbytes)
        out += [of[0], of[-1]] if len(of) > 1 else of
    return out

"""``python -m autopar plan|simulate|calibrate``: plan a model for a (virtual) cluster from the shell.

    python -m autopar plan gpt3-175b --mesh 128x8 --hardware a100-dgx --batch 1536 --seq 2048 \\
        --json plan.json --trace step.json --svg step.svg
    python -m autopar simulate plan.json --svg step.svg
    python -m autopar calibrate --out my.json --model mymodel:make --batch 8 --seq 128
    python -m autopar plan mymodel:make --hardware my.json --mesh 1x2 --batch 8 --seq 128

``MODEL`` is a built-in preset (:func:`autopar.model_presets.preset`: ``gpt3-175b``, ``gpt2-small``,
``llama-7b``, ...) or ``module:function``, a function called with ``batch=`` and ``seq=`` that
returns ``(model, example_inputs)``. ``plan`` runs :func:`autopar.plan` (the setup search, then
the chosen setup's per-operator placements) and prints the plan. ``calibrate`` times the
model's operators and the collectives on this machine's devices (:mod:`autopar.calibrate`) and
writes a topology that ``--hardware`` takes. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "parse_mesh"]


def parse_mesh(text: str, gpus_per_node: int) -> tuple[int, int]:
    """``"NODESxGPUS"`` (``128x8``) or a device count (``1024``, whole nodes of the hardware's
    ``gpus_per_node``) -> ``(nodes, gpus_per_node)``."""
    try:
        if "x" in text:
            nodes, gpus = (int(v) for v in text.lower().split("x"))
        else:
            devices = int(text)
            nodes, gpus = max(devices // gpus_per_node, 1), min(devices, gpus_per_node)
            if nodes * gpus != devices:
                raise ValueError
    except ValueError:
        raise SystemExit(f"--mesh {text!r}: give NODESxGPUS (e.g. 128x8) or a number of devices "
                         f"that is a multiple of {gpus_per_node} (this hardware's GPUs per node)")
    if nodes < 1 or gpus < 1:
        raise SystemExit(f"--mesh {text!r}: nodes and GPUs per node must be at least 1")
    return nodes, gpus


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``plan``, ``simulate`` and ``calibrate``. ``--hardware`` offers the presets
    registered when it is built (:func:`autopar.cost_models.register_topology` adds more)."""
    from autopar.config import ZERO_STAGES
    from autopar.cost_models.topology import preset_names

    parser = argparse.ArgumentParser(prog="python -m autopar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model for a cluster and print the plan")
    p.add_argument("model", help="preset name (gpt3-175b, gpt2-small, llama-7b, ...) or module:function")
    p.add_argument("--mesh", default="1x8", help="NODESxGPUS (128x8) or a device count (default 1x8)")
    p.add_argument("--hardware", default="a100-dgx", metavar="NAME", type=_hardware,
                   help=f"topology preset: {', '.join(preset_names())} (default %(default)s; "
                        f"more with autopar.cost_models.register_topology), or a topology JSON "
                        f"file written by `calibrate`")
    p.add_argument("--batch", type=int, required=True, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    _add_degrees(p)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default=None)
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None)
    p.add_argument("--mixed-precision", choices=("fp32", "bf16"), default=None,
                   help="bf16: run the model under torch.autocast (bf16 matmuls, fp32 master "
                        "weights and gradient reductions) for a model built in fp32 (a "
                        "module:function; the presets are built in bf16, where it changes "
                        "nothing); default and fp32: the model's own dtype")
    p.add_argument("--memory-gib", type=float, default=None, help="per-device budget (default: the hardware's)")
    p.add_argument("--per-operator", action="store_true",
                   help="accepted for older scripts: every plan has per-operator placements now")
    p.add_argument("--operators", action="store_true", help="list every operator")
    p.add_argument("--explain", metavar="TARGET", action="append", default=[],
                   help="why a node, parameter or module is placed as it is (repeatable)")
    _outputs(p)
    s = sub.add_parser("simulate", help="replay a saved plan's step; print it, draw it")
    s.add_argument("plan", help="a plan saved with plan.save / --json")
    _outputs(s, json=False)
    c = sub.add_parser("calibrate", help="time this machine's kernels and collectives; write a "
                                         "topology for --hardware")
    c.add_argument("--out", type=Path, required=True, help="the topology JSON to write")
    c.add_argument("--model", default=None, help="time this model's operators (preset name or "
                                                 "module:function; default: reference kernels only)")
    c.add_argument("--batch", type=int, default=8, help="the model's batch (default 8)")
    c.add_argument("--seq", type=int, default=128, help="the model's sequence length (default 128)")
    c.add_argument("--nproc", type=int, default=None,
                   help="processes (default: the GPUs present, or 2 on CPU)")
    c.add_argument("--base", default=None, help="the preset to start from (default: cpu-gloo on "
                                                "CPU, the GPU's own preset by its name)")
    c.add_argument("--name", default=None, help="the topology's name (default calibrated-BASE)")
    c.add_argument("--mixed-precision", choices=("fp32", "bf16"), default=None,
                   help="capture the model under bf16 autocast, as it will train")
    c.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (noisier)")
    c.add_argument("--compiled", action="store_true",
                   help="fit the pointwise efficiency on the model's torch.compile step (CUDA), "
                        "for training with compile=True")
    c.add_argument("--timings", type=Path, default=None,
                   help="also write every timing (kernels, collectives) to this JSON file")
    return parser


def _add_degrees(p: argparse.ArgumentParser) -> None:
    """``plan``'s degrees and the context- and expert-parallel settings."""
    from autopar.config import CP_ATTENTION, CP_LAYOUTS

    for name in ("dp", "tp", "pp", "cp", "ep", "microbatch-size", "dp-shard"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"fix {name} (default: searched)")
    p.add_argument("--cp-attention", choices=CP_ATTENTION, default=None,
                   help="attention over cp: keys and values gathered, or passed around a ring "
                        "(default: the cheaper per attention)")
    p.add_argument("--cp-layout", choices=CP_LAYOUTS, default=None,
                   help="positions per cp rank: chunk pairs that balance causal attention, or "
                        "contiguous blocks (default: balanced where the sequence divides)")
    p.add_argument("--cp-order", choices=("outside-tp", "inside-tp"), default=None,
                   help="the cp axis's place in the mesh when cp and tp are both > 1: outside "
                        "tp (tp's ranks consecutive) or inside it (default: the faster where "
                        "they differ)")
    p.add_argument("--ep-from", choices=("dp", "cp"), default=None,
                   help="where the expert-parallel ranks come from: cut from dp, or the cp "
                        "ranks (ep = cp) (default: the faster where both fit)")
    p.add_argument("--expert-load-skew", type=float, default=1.0,
                   help="MoE routing skew the cost model assumes: the busiest rank's rows over "
                        "the mean (default 1.0, uniform)")


def _hardware(text: str) -> Any:
    """``--hardware``: a registered preset or a topology JSON file, loaded (once) when parsed:
    the :class:`~autopar.cost_models.topology.Topology`."""
    from autopar.cost_models.topology import load_topology

    try:
        return load_topology(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _outputs(p: argparse.ArgumentParser, json: bool = True) -> None:
    if json:
        p.add_argument("--json", type=Path, help="save the plan as JSON")
    p.add_argument("--trace", type=Path, help="write the simulated step as Chrome trace JSON")
    p.add_argument("--svg", type=Path, help="write the simulated step as an SVG timeline")


def _plan(args: argparse.Namespace) -> Any:
    import autopar
    from autopar.model_presets import load_model

    topo = args.hardware  # (loaded by the parser)
    nodes, gpus = parse_mesh(args.mesh, topo.gpus_per_node)
    mesh = autopar.Mesh.virtual(topo, nodes=nodes, gpus_per_node=gpus)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    say(f"building {args.model} (batch {args.batch}, seq {args.seq}) for {nodes}x{gpus} {topo.name}")
    try:
        model, inputs = load_model(args.model, args.batch, args.seq)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    config = autopar.Config(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                            cp_attention=args.cp_attention, cp_layout=args.cp_layout,
                            cp_inside_tp=None if args.cp_order is None
                            else args.cp_order == "inside-tp",
                            ep_in_cp=None if args.ep_from is None else args.ep_from == "cp",
                            expert_load_skew=args.expert_load_skew,
                            microbatch_size=args.microbatch_size,
                            recompute=args.recompute, zero=args.zero, dp_shard=args.dp_shard,
                            mixed_precision=args.mixed_precision,
                            memory_bytes=args.memory_gib * 2**30 if args.memory_gib else None)
    t0 = time.perf_counter()
    plan = autopar.plan(model, mesh, inputs, config=config, progress=say)
    say(f"planned in {time.perf_counter() - t0:.1f} s")
    return plan


def _write(plan: Any, args: argparse.Namespace) -> None:
    if getattr(args, "json", None):
        plan.save(args.json)
        print(f"plan saved to {args.json}")
    if args.trace:
        print(f"Chrome trace written to {plan.to_chrome_trace(args.trace)}")
    if args.svg:
        print(f"SVG timeline written to {plan.to_svg(args.svg)}")


def _simulate(args: argparse.Namespace) -> Any:
    from autopar.plan import Plan
    from autopar.report.timeline import simulate_plan

    plan = Plan.load(args.plan)
    result = simulate_plan(plan)
    print(f"plan {args.plan}: degrees {plan.degrees}")
    print(f"simulated step {result.step_time_s * 1e3:.3f} ms (plan predicts "
          f"{plan.predicted['step_time_s'] * 1e3:.3f} ms), bubble {result.bubble_fraction:.1%}")
    for rank, busy in enumerate(result.rank_busy_s):
        print(f"  pp rank {rank}: busy {busy * 1e3:.3f} ms, {len(result.actions[rank])} actions")
    return plan


def _calibrate(args: argparse.Namespace) -> None:
    import json

    from autopar.calibrate import calibrate, report

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        result = calibrate(args.model, args.batch, args.seq, nproc=args.nproc, base=args.base,
                           name=args.name, mixed_precision=args.mixed_precision,
                           quick=args.quick, progress=say, compiled=args.compiled)
    except ValueError as e:  # a bad --base / --nproc, an unknown GPU, timings no fit explains
        raise SystemExit(f"calibrate: {e}") from e
    args.out.write_text(json.dumps(result.topology.to_dict(), indent=1) + "\n")
    if args.timings:
        args.timings.write_text(json.dumps(result.timings(), indent=1) + "\n")
    print(report(result))
    for name, error in result.failed:
        print(f"not timed (synthetic inputs): {name}: {error}")
    t = result.topology
    print(f"\n{t.name}: matmul efficiency {t.matmul_efficiency:.3f} of "
          f"{t.peak_flops['fp32'] / 1e9:.1f} GFLOP/s fp32 ({t.peak_flops['bf16'] / 1e9:.1f} bf16), "
          f"pointwise {t.pointwise_efficiency:.3f} of {t.mem_bandwidth_Bps / 1e9:.1f} GB/s; link "
          f"{t.intra_node.bandwidth_Bps / 1e9:.2f} GB/s"
          + "".join(f", {k} {b / 1e9:.2f}" for k, b in t.intra_node.bandwidth_by_kind)
          + f", latency {t.intra_node.latency_s * 1e6:.1f} us, launch {t.intra_node.launch_s * 1e6:.1f} us")
    print(f"topology written to {args.out}: plan with --hardware {args.out}")


def main(argv: list[str]) -> int:
    """Run ``plan``, ``simulate`` or ``calibrate`` with ``argv`` (the words after
    ``python -m autopar``)."""
    args = build_parser().parse_args(argv)
    if args.command == "calibrate":
        _calibrate(args)
        return 0
    if args.command == "plan":
        plan = _plan(args)
        print(plan)
        if args.operators:
            print("\nevery operator\n" + plan.operator_table(expand=True))
        for target in args.explain:
            print(f"\n{plan.explain(target)}")
    else:
        plan = _simulate(args)
    _write(plan, args)
    return 0

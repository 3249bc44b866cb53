"""``python -m autopar plan|simulate``: plan a model for a (virtual) cluster from the shell.

    python -m autopar plan gpt3-175b --mesh 128x8 --hardware a100-dgx --batch 1536 --seq 2048 \\
        --json plan.json --trace step.json --svg step.svg
    python -m autopar simulate plan.json --svg step.svg

``MODEL`` is a built-in preset (:func:`autopar.model_presets.preset`: ``gpt3-175b``, ``gpt2-small``,
``llama-7b``, ...) or ``module:function``, a function called with ``batch=`` and ``seq=`` that
returns ``(model, example_inputs)``. ``plan`` runs :func:`autopar.plan` (the setup search, then
the chosen setup's per-operator placements) and prints the plan. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "parse_mesh", "load_model"]


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


def load_model(spec: str, batch: int, seq: int) -> tuple[Any, Any]:
    """The model and example inputs of ``spec``: a preset name or ``module:function``."""
    if ":" not in spec:
        from autopar.model_presets import preset

        try:
            return preset(spec, batch, seq)
        except ValueError as e:
            raise SystemExit(str(e)) from e
    module, _, fn = spec.partition(":")
    sys.path.insert(0, str(Path.cwd()))
    try:
        target = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"MODEL {spec!r}: cannot load {fn!r} from module {module!r} ({e}); give "
                         f"'module:function' importable from the current directory.") from e
    out = target(batch=batch, seq=seq)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise SystemExit(f"MODEL {spec!r}: {fn}(batch=, seq=) must return (model, example_inputs), "
                         f"got {type(out).__name__}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``plan`` and ``simulate``. ``--hardware`` offers the presets
    registered when it is built (:func:`autopar.cost_models.register_topology` adds more)."""
    from autopar.config import ZERO_STAGES
    from autopar.cost_models.topology import preset_names

    parser = argparse.ArgumentParser(prog="python -m autopar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model for a cluster and print the plan")
    p.add_argument("model", help="preset name (gpt3-175b, gpt2-small, llama-7b, ...) or module:function")
    p.add_argument("--mesh", default="1x8", help="NODESxGPUS (128x8) or a device count (default 1x8)")
    p.add_argument("--hardware", default="a100-dgx", choices=preset_names(), metavar="NAME",
                   help="topology preset: %(choices)s (default %(default)s; more with "
                        "autopar.cost_models.register_topology)")
    p.add_argument("--batch", type=int, required=True, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    for name in ("dp", "tp", "pp", "cp", "ep", "microbatch-size", "dp-shard"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"fix {name} (default: searched)")
    p.add_argument("--expert-load-skew", type=float, default=1.0,
                   help="MoE routing skew the cost model assumes: the busiest rank's rows over "
                        "the mean (default 1.0, uniform)")
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
    return parser


def _outputs(p: argparse.ArgumentParser, json: bool = True) -> None:
    if json:
        p.add_argument("--json", type=Path, help="save the plan as JSON")
    p.add_argument("--trace", type=Path, help="write the simulated step as Chrome trace JSON")
    p.add_argument("--svg", type=Path, help="write the simulated step as an SVG timeline")


def _plan(args: argparse.Namespace) -> Any:
    import autopar
    from autopar.cost_models.topology import get_preset

    topo = get_preset(args.hardware)
    nodes, gpus = parse_mesh(args.mesh, topo.gpus_per_node)
    mesh = autopar.Mesh.virtual(topo, nodes=nodes, gpus_per_node=gpus)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    say(f"building {args.model} (batch {args.batch}, seq {args.seq}) for {nodes}x{gpus} {topo.name}")
    model, inputs = load_model(args.model, args.batch, args.seq)
    config = autopar.Config(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
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


def main(argv: list[str]) -> int:
    """Run ``plan`` or ``simulate`` with ``argv`` (the words after ``python -m autopar``)."""
    args = build_parser().parse_args(argv)
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

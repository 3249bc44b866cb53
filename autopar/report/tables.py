"""Tables of a plan for people: the summary ``print(plan)`` shows, the pipeline stages, the
predicted step broken down, one line per operator (or per layer), and what differs between two
plans. Functions of a :class:`autopar.plan.Plan`; nothing of the planner is read."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from tabulate import tabulate

__all__ = ["breakdown_table", "compare", "operator_table", "render", "stage_table"]


def stage_table(plan: Any) -> str:
    pipe = plan.pipeline
    times = pipe.predicted.get("stage_time_s", [])
    forward = pipe.predicted.get("stage_forward_s") or [
        s.predicted.get("forward_s", 0.0) for s in pipe.stages]
    memory = pipe.predicted.get("peak_memory_bytes", [])
    stage_memory = pipe.predicted.get("stage_memory_bytes") or [
        s.predicted.get("peak_memory_bytes", 0.0) for s in pipe.stages]
    pp = plan.degrees.get("pp", 1)
    per_rank = max(1, plan.degrees.get("dp", 1) * plan.degrees.get("cp", 1) * plan.degrees.get("tp", 1))
    rows = []
    for j in range(pipe.num_stages):
        units = pipe.stage_units(j)
        span = units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)})"
        first = (j % pp) * per_rank  # the pp axis is outermost: rank = pp_rank * dp * cp * tp + ...
        devices = f"{first}" if per_rank == 1 else f"{first}-{first + per_rank - 1}"
        fw = forward[j] if j < len(forward) else None
        rows.append([j, devices, span,
                     f"{fw * 1e3:.3f}" if fw is not None else "",
                     f"{(times[j] - fw) * 1e3:.3f}" if fw is not None and j < len(times) else "",
                     f"{stage_memory[j] / 2**20:.1f}" if j < len(stage_memory) else "",
                     f"{memory[j % pp] / 2**20:.1f}" if j % pp < len(memory) else ""])
    return tabulate(rows, headers=["stage", "ranks", "layers", "forward ms / mb",
                                   "backward ms / mb", "stage peak MiB", "rank peak MiB"])


def breakdown_table(plan: Any) -> str:
    parts = plan.step_breakdown()
    total = parts["total_s"] or 1.0
    rows = [[label, f"{parts[k] * 1e3:.3f}", f"{parts[k] / total:.1%}"]
            for k, label in (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"),
                             ("bubble_s", "pipeline bubble"), ("optimizer_s", "optimizer"))]
    rows.append(["training step", f"{parts['total_s'] * 1e3:.3f}", "100.0%"])
    return tabulate(rows, headers=["predicted step", "ms", "share"])


def operator_table(plan: Any, expand: bool | Sequence[str] = False) -> str:
    """Per operator: its placements per mesh axis (outputs, then the inputs it needs) and
    its predicted compute and communication milliseconds per step.

    ``expand=False`` collapses each layer to one line (layers with identical figures in a
    row share one line), ``True`` lists every operator, a list of layer names (``"blocks.3"``,
    ``""`` for nodes outside the repeated layers) lists those layers' operators. A pipelined
    plan's operators are in its stages: ``plan.pipeline.stages[j].operator_table()``.
    """
    if not plan.nodes:
        return "(no per-operator choices in this plan)"
    ops = [(name, n) for name, n in plan.nodes.items() if n.op and n.op not in ("placeholder", "getitem")]
    if not ops:
        return "(this plan was saved without per-operator costs; plan again to see them)"
    show = (lambda layer: True) if expand is True else (
        (lambda layer: False) if expand is False else (lambda layer, e=set(expand): layer in e))
    fmt = lambda pl: "[" + ", ".join(pl) + "]" if pl is not None else "-"  # noqa: E731
    by_layer: dict[str, list[tuple[str, Any]]] = {}
    for name, n in ops:
        by_layer.setdefault(n.layer, []).append((name, n))
    rows: list[list[Any]] = []
    for layer, members in by_layer.items():
        if show(layer):
            rows += [[name, n.op, n.module or "-", n.phase, " ".join(fmt(o) for o in n.outputs),
                      " ".join(fmt(i) for i in n.inputs), f"{n.compute_s * 1e3:.4f}",
                      f"{n.comm_s * 1e3:.4f}"] for name, n in members]
            continue
        fw = sum(n.compute_s for _, n in members if n.phase == "forward")
        bw = sum(n.compute_s for _, n in members if n.phase != "forward")
        comm = sum(n.comm_s for _, n in members)
        row = [layer or "(outside the layers)", f"{len(members)} ops", "", "", "", "",
               f"{fw * 1e3:.4f} fw + {bw * 1e3:.4f} bw", f"{comm * 1e3:.4f}"]
        prev = rows[-1] if rows else None
        if prev is not None and prev[1:] == row[1:] and layer and prev[0].startswith(
                layer.rsplit(".", 1)[0] + "."):
            prev[0] = prev[0].split(" .. ")[0] + f" .. {layer}"
        else:
            rows.append(row)
    return tabulate(rows, headers=["node / layer", "op", "module", "phase", "outputs per axis",
                                   "inputs per axis", "compute ms", "comm ms"])


def compare(plan: Any, other: Any) -> str:
    """What differs between this plan (``A``) and ``other`` (``B``), as tables: degrees,
    schedule, techniques and predictions, collectives by kind, and the parameters placed
    differently."""
    def summary(p: Any) -> dict[str, Any]:
        pipe = p.pipeline
        return {"mesh": " x ".join(f"{n}={s}" for n, s in zip(p.axis_names, p.mesh_shape)),
                **{f"degree {k}": v for k, v in p.degrees.items()},
                "schedule": f"{pipe.schedule} v={pipe.virtual_stages} m={pipe.microbatches}"
                if pipe else "none",
                **{f"technique {k}": v for k, v in p.techniques.items()},
                "step ms": round(p.predicted.get("step_time_s", 0.0) * 1e3, 3),
                "peak MiB / device": round(p.predicted.get("peak_memory_bytes", 0.0) / 2**20, 1),
                **{f"{k} per step": v for k, v in sorted(p.collective_counts().items())}}

    a, b = summary(plan), summary(other)
    rows = [[k, a.get(k, "-"), b.get(k, "-")] for k in dict.fromkeys([*a, *b])
            if a.get(k, "-") != b.get(k, "-")]
    parts = [tabulate(rows, headers=["", "A", "B"]) if rows else "same setup and predictions"]
    moved = [[n, ", ".join(plan.params[n]), ", ".join(other.params[n])]
             for n in plan.params if n in other.params and plan.params[n] != other.params[n]]
    if moved:
        parts += ["", f"parameters placed differently ({len(moved)})",
                  tabulate(moved, headers=["name", "A", "B"])]
    return "\n".join(parts)


def render(plan: Any) -> str:
    head = [
        ["mesh", " x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
         + f" ({plan.topology})"],
        ["degrees", ", ".join(f"{k}={v}" for k, v in plan.degrees.items())],
        ["predicted step time", f"{plan.predicted.get('step_time_s', 0) * 1e3:.3f} ms"],
        ["  compute / comm", f"{plan.predicted.get('compute_s', 0) * 1e3:.3f} / "
                             f"{plan.predicted.get('comm_s', 0) * 1e3:.3f} ms"],
        ["peak memory / device", f"{plan.predicted.get('peak_memory_bytes', 0) / 2**20:.1f} MiB"],
        *([["model FLOPs / MFU", f"{plan.predicted['model_flops'] / 1e12:.4g} TFLOP per step, "
                                 f"MFU {plan.predicted['mfu']:.1%}"]]
          if "mfu" in plan.predicted else []),
        ["solver", f"{plan.solver.get('status')} ({plan.solver.get('backend')}, gap "
                   f"{plan.solver.get('gap', 0):.2g}, {plan.solver.get('solve_time_s', 0):.2f} s)"],
    ]
    if plan.techniques:
        head += [["techniques", ", ".join(f"{k}={v}" for k, v in plan.techniques.items())]]
    if plan.pipeline is not None:
        pipe = plan.pipeline
        head += [["pipeline", f"{pipe.schedule}, {pipe.num_stages} stages ({pipe.virtual_stages} "
                              f"per rank), {pipe.microbatches} microbatches of "
                              f"{pipe.microbatch_size}"],
                 ["  idle", f"{pipe.predicted.get('bubble_fraction', 0):.1%} of the step, "
                            f"mean over pipeline ranks"]]
    parts = ["autopar plan", tabulate(head, tablefmt="simple"), "", breakdown_table(plan)]
    if plan.pipeline is not None:
        parts += ["", "pipeline stages", stage_table(plan)]
    if plan.nodes:
        many = sum(1 for n in plan.nodes.values() if n.op not in ("", "placeholder", "getitem")) > 40
        parts += ["", "operators" + (" (one line per layer; operator_table(plan, expand=True) "
                                     "lists each)" if many else ""),
                  operator_table(plan, expand=not many)]
    if plan.params:
        prm = [[name, "[" + ", ".join(p) + "]"] for name, p in plan.params.items()]
        parts += ["", "parameters", tabulate(prm, headers=["name", "placement per axis"])]
    counts: Counter = Counter((c.layer or "-", c.phase, c.kind, c.axis) for c in plan.collectives)
    nbytes: Counter = Counter()
    for c in plan.collectives:
        nbytes[(c.layer or "-", c.phase, c.kind, c.axis)] += c.bytes
    rows = [[*k, v, nbytes[k]] for k, v in counts.items()]
    if rows or plan.params:
        parts += ["", "collectives per step",
                  tabulate(rows, headers=["layer", "phase", "kind", "axis", "count", "bytes"])
                  if rows else "(none)"]
    alts = [[a.get("setup", a.get("degrees")), f"{a['step_time_s'] * 1e3:.3f}"]
            for a in plan.alternatives if "step_time_s" in a]
    if alts:
        parts += ["", "alternatives", tabulate(alts, headers=["setup", "predicted step ms"])]
    if plan.warnings:
        parts += ["", "warnings"] + [f"- {w}" for w in plan.warnings]
    return "\n".join(parts)

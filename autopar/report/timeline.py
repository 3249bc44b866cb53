"""Pictures of a plan's step: the simulated schedule as a Chrome trace and as an SVG timeline.

:func:`simulate_plan` replays the plan's step with the pipeline simulator
(:func:`autopar.cost_models.pipeline.simulate`) from the per-stage forward and backward times
the plan predicts; a plan without a pipeline is one rank running one forward and one backward.
:func:`to_chrome_trace` writes it as Chrome trace-event JSON (open in Perfetto or
``chrome://tracing``): one track per pipeline rank for compute and one for its point-to-point
sends. :func:`to_svg` draws the same as a standalone SVG (no dependencies).
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from autopar.cost_models.pipeline import ScheduleResult, simulate
from autopar.errors import PlanError

__all__ = ["simulate_plan", "trace_events", "to_chrome_trace", "to_svg"]

_NAMES = {"F": "forward", "B": "backward (input)", "W": "backward (weights)", "BW": "backward"}
_COLORS = {"F": "#4e79a7", "B": "#59a14f", "W": "#f28e2b", "BW": "#59a14f", "send": "#9c9c9c"}


def simulate_plan(plan: Any) -> ScheduleResult:
    """The plan's step as the simulator runs it (times in seconds, per rank)."""
    pipe = plan.pipeline
    if pipe is None:
        fwd = float(plan.predicted.get("forward_s", 0.0))
        bwd = max(float(plan.predicted["step_time_s"]) - fwd, 0.0)
        return simulate("1f1b", [fwd], [bwd], 1, 1)
    if pipe.stages:
        fw = [float(st.predicted["forward_s"]) for st in pipe.stages]
        bw = [max(float(st.predicted["step_time_s"]) - f, 0.0) for st, f in zip(pipe.stages, fw)]
    elif "stage_forward_s" in pipe.predicted:  # the cluster search's planning view
        fw = [float(t) for t in pipe.predicted["stage_forward_s"]]
        bw = [max(float(t) - f, 0.0) for t, f in zip(pipe.predicted["stage_time_s"], fw)]
    else:
        raise PlanError("this plan has no per-stage forward times to simulate (saved by an older "
                        "autopar); re-plan it to draw its timeline.")
    # plans saved before p2p_s was recorded are replayed without transfer time
    return simulate(pipe.schedule, fw, bw, pipe.microbatches, plan.degrees["pp"],
                    p2p_s=float(pipe.predicted.get("p2p_s", 0.0)),
                    weight_fraction=float(pipe.predicted.get("weight_fraction", 0.5)))


def _sends(result: ScheduleResult, ranks: int, p2p_s: float) -> list[tuple[int, str, int, int, float]]:
    """Point-to-point transfers ``(rank, kind, stage, microbatch, start_s)``: a forward whose next
    stage is on another rank sends activations; a backward whose previous stage is on another
    rank sends gradients."""
    stages = 1 + max((a[1] for acts in result.actions for a in acts), default=0)
    out = []
    for rank, acts in enumerate(result.actions):
        for kind, stage, mb, _start, end in acts:
            if kind == "F" and stage + 1 < stages and (stage + 1) % ranks != rank:
                out.append((rank, "activations", stage, mb, end))
            elif kind in ("B", "BW") and stage > 0 and (stage - 1) % ranks != rank:
                out.append((rank, "gradients", stage, mb, end))
    return out


def trace_events(plan: Any) -> list[dict[str, Any]]:
    """Chrome trace events of the simulated step: metadata naming each track, then one complete
    (``"X"``) event per action and per transfer, in microseconds."""
    result = simulate_plan(plan)
    ranks = len(result.actions)
    p2p_s = float(plan.pipeline.predicted.get("p2p_s", 0.0)) if plan.pipeline else 0.0
    events: list[dict[str, Any]] = [{"ph": "M", "pid": 0, "name": "process_name",
                                     "args": {"name": f"autopar plan {plan.degrees}"}}]
    for rank in range(ranks):
        events.append({"ph": "M", "pid": 0, "tid": 2 * rank, "name": "thread_name",
                       "args": {"name": f"pp rank {rank}"}})
        events.append({"ph": "M", "pid": 0, "tid": 2 * rank + 1, "name": "thread_name",
                       "args": {"name": f"pp rank {rank} sends"}})
    for rank, acts in enumerate(result.actions):
        for kind, stage, mb, start, end in acts:
            events.append({"ph": "X", "pid": 0, "tid": 2 * rank, "name": f"{kind} mb{mb}",
                           "cat": _NAMES[kind], "ts": start * 1e6, "dur": (end - start) * 1e6,
                           "args": {"stage": stage, "microbatch": mb, "kind": _NAMES[kind]}})
    for rank, what, stage, mb, start in _sends(result, ranks, p2p_s):
        events.append({"ph": "X", "pid": 0, "tid": 2 * rank + 1, "name": f"send {what} mb{mb}",
                       "cat": "communication", "ts": start * 1e6, "dur": p2p_s * 1e6,
                       "args": {"stage": stage, "microbatch": mb}})
    return events


def to_chrome_trace(plan: Any, path: str | Path) -> Path:
    """Write the simulated step as Chrome trace JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": trace_events(plan), "displayTimeUnit": "ms"}))
    return path


def to_svg(plan: Any, path: str | Path, width: int = 1000) -> Path:
    """Write the simulated step as an SVG timeline (one row per rank, one box per action,
    labelled with its microbatch; transfers as thin grey bars under the row)."""
    result = simulate_plan(plan)
    ranks = len(result.actions)
    p2p_s = float(plan.pipeline.predicted.get("p2p_s", 0.0)) if plan.pipeline else 0.0
    step = max(result.step_time_s, 1e-12)
    left, row, top = 90, 40, 30
    scale = (width - left - 10) / step
    height = top + ranks * row + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="18">{escape(_title(plan, result))}</text>']
    for rank, acts in enumerate(result.actions):
        y = top + rank * row
        parts.append(f'<text x="4" y="{y + 17}">pp rank {rank}</text>')
        for kind, stage, mb, start, end in acts:
            x, w = left + start * scale, max((end - start) * scale, 0.5)
            parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="24" '
                         f'fill="{_COLORS[kind]}" stroke="white" stroke-width="0.5">'
                         f'<title>{escape(_NAMES[kind])} stage {stage} microbatch {mb}: '
                         f'{(end - start) * 1e3:.3f} ms</title></rect>')
            if w > 14:
                parts.append(f'<text x="{x + w / 2:.2f}" y="{y + 16}" fill="white" '
                             f'text-anchor="middle">{mb}</text>')
    for rank, what, stage, mb, start in _sends(result, ranks, p2p_s):
        y = top + rank * row + 27
        parts.append(f'<rect x="{left + start * scale:.2f}" y="{y}" width="{max(p2p_s * scale, 0.5):.2f}" '
                     f'height="5" fill="{_COLORS["send"]}"><title>send {what} of microbatch {mb}'
                     f'</title></rect>')
    axis_y = top + ranks * row + 12
    for k in range(6):
        x = left + k * (width - left - 10) / 5
        parts.append(f'<text x="{x:.2f}" y="{axis_y + 12}" text-anchor="middle">'
                     f'{k * step / 5 * 1e3:.3g} ms</text>')
    parts.append("</svg>")
    path = Path(path)
    path.write_text("\n".join(parts))
    return path


def _title(plan: Any, result: ScheduleResult) -> str:
    pipe = plan.pipeline
    sched = f"{pipe.schedule}, {pipe.microbatches} microbatches, " if pipe else ""
    return (f"{plan.degrees} {sched}step {result.step_time_s * 1e3:.3f} ms, "
            f"bubble {result.bubble_fraction:.1%}")

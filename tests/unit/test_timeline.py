"""Looking at a plan: the Chrome trace and the SVG timeline of the simulated step
(autopar.report.timeline), and Plan.compare."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

import autopar
from autopar.report.timeline import simulate_plan
from models import build


@pytest.fixture(scope="module")
def pipelined():
    model, inputs = build("gpt", layers=2, batch=8)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)
    return autopar.plan(model, mesh, inputs, config=autopar.Config(
        pp=2, schedule="1f1b", microbatch_size=2, dp=1, tp=1))


def test_chrome_trace_has_a_track_per_rank_and_every_microbatch(pipelined, tmp_path):
    path = pipelined.to_chrome_trace(tmp_path / "step.json")
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert sorted(n for n in tracks.values() if not n.endswith("sends")) == ["pp rank 0", "pp rank 1"]
    m = pipelined.pipeline.microbatches
    for rank in (0, 1):
        work = [e for e in events if e["ph"] == "X" and e["tid"] == 2 * rank]
        # each of the rank's stages runs a forward and a backward of every microbatch
        for kind in ("forward", "backward"):
            for stage in {e["args"]["stage"] for e in work}:
                mbs = sorted(e["args"]["microbatch"] for e in work
                             if e["cat"] == kind and e["args"]["stage"] == stage)
                assert mbs == list(range(m)), (rank, kind, stage, mbs)
        assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in work)
    sends = [e for e in events if e["ph"] == "X" and e["cat"] == "communication"]
    assert sends and pipelined.pipeline.predicted["p2p_s"] > 0
    end = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X" and e["cat"] != "communication")
    # the trace is the simulation the plan's step time comes from
    assert end == pytest.approx(simulate_plan(pipelined).step_time_s * 1e6)
    assert simulate_plan(pipelined).step_time_s <= pipelined.pipeline.predicted["step_time_s"]


def test_svg_timeline_parses_with_a_box_per_action(pipelined, tmp_path):
    root = ET.parse(pipelined.to_svg(tmp_path / "step.svg")).getroot()
    assert root.tag.endswith("svg")
    ns = "{http://www.w3.org/2000/svg}"
    boxes = [r for r in root.iter(f"{ns}rect") if "microbatch" in r.findtext(f"{ns}title", "")
             and not r.findtext(f"{ns}title", "").startswith("send")]
    actions = sum(len(a) for a in simulate_plan(pipelined).actions)
    # every stage: a forward and a backward of every microbatch
    assert len(boxes) == actions == 2 * pipelined.pipeline.num_stages * pipelined.pipeline.microbatches
    labels = {t.text for t in root.iter(f"{ns}text")}
    assert {"pp rank 0", "pp rank 1"} <= labels


def test_a_plan_without_pipeline_is_one_rank_forward_then_backward(tmp_path):
    model, inputs = build("mlp")
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", gpus_per_node=1), inputs)
    events = json.loads(plan.to_chrome_trace(tmp_path / "t.json").read_text())["traceEvents"]
    work = [(e["cat"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    assert [w[0] for w in work] == ["forward", "backward"]
    assert (work[1][1] + work[1][2]) / 1e6 == pytest.approx(plan.predicted["step_time_s"])


def test_compare_lists_only_what_differs(pipelined):
    model, inputs = build("gpt", layers=2, batch=8)
    flat = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2), inputs,
                        config=autopar.Config(pp=1, dp=2, recompute="none", zero=0))
    text = pipelined.compare(flat)
    rows = {line.split("  ")[0].strip() for line in text.splitlines()[2:] if line.strip()}
    assert {"degree pp", "degree dp", "schedule", "step ms"} <= rows, text
    assert "degree tp" not in rows  # the same in both: not listed
    assert pipelined.compare(pipelined) == "same setup and predictions"


def test_step_breakdown_of_a_pipelined_plan(pipelined):
    parts = pipelined.step_breakdown()
    step = pipelined.predicted["step_time_s"]
    # the pipelined step is forward and backward; the optimizer comes after it
    assert parts["total_s"] == pytest.approx(step + parts["optimizer_s"], rel=1e-9)
    pipe = pipelined.pipeline
    busiest = pipe.microbatches * max(sum(pipe.predicted["stage_time_s"][r::2]) for r in range(2))
    # the busiest rank's idle time is the fill/drain bubble plus the 2 (pp - 1) sends on it
    sends = 2 * (2 - 1) * pipe.predicted["p2p_s"]
    assert parts["bubble_s"] == pytest.approx(step - busiest - sends, rel=1e-9)
    assert parts["bubble_s"] > 0 and parts["exposed_comm_s"] >= sends * (1 - 1e-9) and sends > 0
    assert sum(parts[k] for k in ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")) \
        == pytest.approx(parts["total_s"], rel=1e-9)
    text = str(pipelined)
    assert "forward ms / mb" in text and "ranks" in text and "pipeline bubble" in text


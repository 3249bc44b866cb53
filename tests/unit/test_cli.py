"""The command line: ``python -m autopar plan`` (presets and module:function) and ``simulate``."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.__main__ import main
from autopar.cli import parse_mesh


def test_plan_a_preset_then_simulate_the_saved_plan(tmp_path, capsys):
    p, trace, svg = tmp_path / "p.json", tmp_path / "t.json", tmp_path / "s.svg"
    # pp and the microbatch size fixed: one trace, a few seconds
    assert main(["plan", "gpt-1.7b", "--mesh", "2x8", "--hardware", "a100-dgx", "--batch", "64",
                 "--seq", "512", "--pp", "2", "--microbatch-size", "1", "--json", str(p),
                 "--trace", str(trace), "--svg", str(svg)]) == 0
    out, err = capsys.readouterr()
    assert "autopar plan" in out and "pipeline stages" in out and "planned in" in err
    plan = autopar.Plan.load(p)
    assert plan.degrees["pp"] == 2 and plan.degrees["dp"] * plan.degrees["tp"] == 8
    events = json.loads(trace.read_text())["traceEvents"]
    ranks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"pp rank 0", "pp rank 1"} <= ranks
    m = plan.pipeline.microbatches
    forwards = {(e["tid"], e["args"]["microbatch"]) for e in events if e.get("cat") == "forward"}
    assert forwards == {(2 * r, mb) for r in (0, 1) for mb in range(m)}
    assert svg.read_text().startswith("<svg")
    assert main(["simulate", str(p)]) == 0
    out = capsys.readouterr().out
    assert "simulated step" in out and "pp rank 1" in out


def test_plan_a_module_function_per_operator(tmp_path, capsys, model_module):
    assert main(["plan", "mymodel:make", "--mesh", "1x2", "--hardware", "cpu-gloo", "--batch", "8",
                 "--seq", "16", "--per-operator", "--operators", "--explain", "blocks.0.fc1"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "every operator" in out and "aten.addmm" in out
    assert "why 'blocks.0.fc1'" in out and "vs chosen" in out
    # every plan has per-operator placements: --explain needs no other flag
    assert main(["plan", "mymodel:make", "--mesh", "1x2", "--hardware", "cpu-gloo", "--batch", "8",
                 "--seq", "16", "--explain", "blocks.0.fc1"]) == 0
    assert "why 'blocks.0.fc1'" in capsys.readouterr().out
    # a forced degree reaches the plan: context parallelism's cp
    saved = tmp_path / "cp.json"
    assert main(["plan", "mymodel:make", "--mesh", "1x2", "--hardware", "cpu-gloo", "--batch", "8",
                 "--seq", "16", "--cp", "2", "--json", str(saved)]) == 0
    assert autopar.Plan.load(saved).degrees["cp"] == 2
    # and bf16 autocast
    assert main(["plan", "mymodel:make", "--mesh", "1x2", "--hardware", "cpu-gloo", "--batch", "8",
                 "--seq", "16", "--mixed-precision", "bf16", "--json", str(saved)]) == 0
    assert autopar.Plan.load(saved).techniques["mixed_precision"] == "bf16-autocast"
    with pytest.raises(SystemExit, match="cannot load"):
        main(["plan", "mymodel:nope", "--batch", "8"])
    with pytest.raises(SystemExit, match="unknown model preset"):
        main(["plan", "gpt-unknown", "--batch", "8"])


def test_mesh_argument():
    assert parse_mesh("128x8", 8) == (128, 8)
    assert parse_mesh("1024", 8) == (128, 8)
    assert parse_mesh("4", 8) == (1, 4)
    with pytest.raises(SystemExit, match="NODESxGPUS"):
        parse_mesh("12", 8)
    with pytest.raises(SystemExit, match="NODESxGPUS"):
        parse_mesh("eight", 8)
    assert main([]) == 2  # usage

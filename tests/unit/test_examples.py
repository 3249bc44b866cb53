"""Every example of ``examples/`` runs, at small sizes, so none rots. The planning examples run
here, in this process; the training ones in one 2-process job of ``tests/distributed``
(``test_examples_train.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import autopar

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True, scope="module")
def examples_importable():
    sys.path.insert(0, str(EXAMPLES))  # as `python examples/x.py` has it
    yield
    sys.path.remove(str(EXAMPLES))


def test_plan_gpt3_example_searches_a_virtual_cluster(tmp_path, capsys):
    import plan_gpt3

    # the example's defaults plan GPT-3 175B on 1,024 GPUs (about 20 s); the smallest preset
    # on 2 GPUs goes through the same code
    plan = plan_gpt3.main(["--preset", "gpt2-small", "--nodes", "1", "--gpus-per-node", "2",
                           "--batch", "4", "--seq", "64", "--json", str(tmp_path / "p.json"),
                           "--trace", str(tmp_path / "t.json"), "--svg", str(tmp_path / "s.svg")])
    out = capsys.readouterr().out
    assert "autopar plan" in out and "TFLOP/s per GPU" in out
    assert plan.degrees["dp"] * plan.degrees["tp"] * plan.degrees["pp"] == 2
    assert autopar.Plan.load(tmp_path / "p.json").degrees == plan.degrees
    assert (tmp_path / "t.json").stat().st_size > 0 and (tmp_path / "s.svg").stat().st_size > 0


def test_custom_cost_pass_example_keeps_tensor_parallelism_inside_nodes(capsys):
    import custom_cost_pass as example

    free, kept = example.main([])
    assert "A: autopar's own choice" in capsys.readouterr().out
    # 2 nodes of 2 GPUs: without the pass, parameters are split over the 4-device axis that
    # spans both nodes; with it, only over axes inside a node
    far = lambda plan: [a for a in range(len(plan.mesh_shape))  # noqa: E731
                        if example.spans_nodes(plan.mesh_shape, a, 2)]
    assert any(p[a] != "R" for p in free.params.values() for a in far(free))
    assert kept.degrees["tp"] > 1  # still tensor parallel, inside the nodes
    assert all(p[a] == "R" for p in kept.params.values() for a in far(kept))
    assert kept.predicted["step_time_s"] >= free.predicted["step_time_s"]  # the price of policy


def test_custom_op_rule_example_is_used_by_the_solver(capsys):
    import custom_op_rule as example

    before, after = example.main(["--dim", "1024", "--tokens", "256"])
    out = capsys.readouterr().out
    assert "with the rule" in out
    ops = lambda plan: {n.op: n for n in plan.nodes.values() if "scaled_gelu" in n.op}  # noqa: E731
    assert len(ops(before)) == len(ops(after)) == 2  # forward and backward ops
    assert all(n.outputs[0] == ("R",) for n in ops(before).values())  # no rule: replicated
    assert any("no sharding rule" in w and "scaled_gelu" in w for w in before.warnings)
    # with the rule the Megatron layout runs through the op: split on the hidden dim
    assert all(n.outputs[0] == ("S(1)",) for n in ops(after).values())
    assert not any("scaled_gelu" in w for w in after.warnings)

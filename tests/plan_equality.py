"""One assertion shared by the tests that plan a pipelined model two ways which must give the same
plan (stage copies against traces, an unrolled export against the whole one, stage workers
against placing in order)."""

from __future__ import annotations

from autopar.plan import Plan

__all__ = ["assert_same_pipeline_plan"]


def assert_same_pipeline_plan(a: Plan, b: Plan, same_names: bool = True) -> None:
    """``a`` and ``b`` are the same pipelined plan: the cut, every parameter's placement, the
    collectives, the predictions, and per stage its parameters, nodes and collectives.
    ``same_names`` False: the stages' node tables are compared by position, not by node name
    (a joint graph unrolled from a short trace names its copies otherwise)."""
    assert a.pipeline.stage_of_unit == b.pipeline.stage_of_unit
    assert a.params == b.params
    assert a.collectives == b.collectives
    assert a.predicted == b.predicted
    assert len(a.pipeline.stages) == len(b.pipeline.stages)
    for x, y in zip(a.pipeline.stages, b.pipeline.stages):
        assert x.params == y.params and x.collectives == y.collectives
        if same_names:
            assert x.nodes == y.nodes
        else:
            assert list(x.nodes.values()) == list(y.nodes.values())

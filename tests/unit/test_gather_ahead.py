"""autopar.runtime.prefetch: ZeRO-3 pipeline gathers issued one action ahead, without a
process group (the issues are recorded; the 4-process pipeline checks run the real ones and
count them against the plan: test_pipeline.py)."""

from __future__ import annotations

import pytest
import torch

from autopar.cost_models.pipeline import action_order
from autopar.runtime.prefetch import GatherAhead, gathering_stages


def _recording(stages):
    log = []

    def issue_of(stage):
        def issue():
            log.append(("issue", stage))

            def wait():
                log.append(("wait", stage))
                return {f"w{stage}": torch.full((2,), float(stage))}

            return wait
        return issue

    return log, {s: issue_of(s) for s in stages}


def test_each_gather_is_issued_when_the_action_before_it_takes_its_own():
    """A rank of interleaved 1F1B (stages 0 and 2): the order is every forward and backward
    of the schedule, the first gather issued and waited at once, each later one issued right
    after the action before it got its parameters, so it travels while that action computes."""
    order = gathering_stages(action_order("interleaved-1f1b", 2, 2, 4)[0], {0, 2})
    assert len(order) == 2 * 2 * 4 and order[0] == 0
    log, issues = _recording({0, 2})
    ahead = GatherAhead(order, issues)
    ahead.start_step()
    for k, stage in enumerate(order):
        got = ahead.take(stage)
        assert got[f"w{stage}"].tolist() == [float(stage)] * 2
        waits = [e for e in log if e[0] == "wait"]
        assert waits[-1] == ("wait", stage) and len(waits) == k + 1
        if k + 1 < len(order):  # the next one's in flight, not yet waited for
            assert log[-1] == ("issue", order[k + 1])
    assert ahead.issued == len(order)
    assert [e[1] for e in log if e[0] == "issue"] == list(order)
    # the next step starts again from its first gather
    ahead.start_step()
    ahead.take(order[0])
    assert log[-2:] == [("wait", order[0]), ("issue", order[1])] and ahead.issued == len(order) + 2


def test_an_action_out_of_order_gathers_at_once_and_says_so():
    """Should the schedule run a stage the order did not predict, its parameters are still the
    right ones (gathered at once; the gather issued for the predicted action is waited for and
    dropped), a warning says that the run's all-gathers differ from the plan's, and the rest of
    the step gathers at once. A step that failed leaves no gather in flight for the next."""
    log, issues = _recording({0, 1})
    ahead = GatherAhead((0, 0, 1, 1), issues)
    ahead.start_step()
    assert ahead.take(0)["w0"][0] == 0.0
    with pytest.warns(RuntimeWarning, match="has stage 0"):
        got = ahead.take(1)
    assert "w1" in got and log[-2:] == [("issue", 1), ("wait", 1)]
    assert ahead.take(1)["w1"][0] == 1.0 and log[-1] == ("wait", 1)  # (no more issued ahead)
    ahead.start_step()
    ahead.take(0)
    ahead.start_step()  # (a step that failed after its first action: its pending one dropped)
    assert log[-1] == ("wait", 0)
    with pytest.raises(ValueError, match="no gather"):
        GatherAhead((0, 3), issues)

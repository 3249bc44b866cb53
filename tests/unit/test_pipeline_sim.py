"""Unit tests for autopar.cost_models.pipeline: the pipeline-schedule simulator.

Tolerances: stage times are chosen as small binary-exact floats (1.0, 2.0, 0.25, ...) wherever a
test checks a closed form, so sums of them are exact and only the final division in a fraction
rounds (rel=1e-12). Where per-chunk times such as 1/3 are not binary-exact, a step adds up a few
hundred of them, so the accumulated rounding stays far below rel=1e-9.
"""

from __future__ import annotations

import itertools
import random
import types

import pytest

from autopar.cost_models.pipeline import (
    SCHEDULES,
    TORCH_SCHEDULE_CLASSES,
    ScheduleResult,
    _execute,
    _one_f_one_b_order,
    action_order,
    check_schedule,
    closed_form_bubble,
    in_flight,
    simulate,
)

EXACT = 1e-12  # binary-exact inputs: only the last division rounds
SUMS = 1e-9  # non-exact per-chunk times summed a few hundred times

F, B = 1.0, 2.0  # uniform per-stage forward / backward seconds (binary-exact)


def _valid(schedule: str, p: int, v: int, m: int) -> bool:
    try:
        check_schedule(schedule, p, v, m)
    except ValueError:
        return False
    return True


def _uniform(schedule: str, p: int, v: int, m: int, **kw) -> ScheduleResult:
    """Whole-model forward F and backward B split evenly over the v chunks of each rank."""
    return simulate(schedule, [F / v] * (p * v), [B / v] * (p * v), m, p, **kw)


# ---------------------------------------------------------------- torch cross-check helpers


def _torch_order(schedule: str, p: int, v: int, m: int):
    """Torch's own ``pipeline_order`` in this module's action format (test-only helper).

    Built from duck-typed stand-in stages (no process group). Relies on torch internals checked
    against torch 2.13: stage attributes ``stage_index``, ``num_stages``, ``group_rank``,
    ``group_size``, ``submod`` and the ``_Action`` fields ``stage_index``, ``computation_type``
    (values "F", "B" = full backward, "I" = input grad, "W"), ``microbatch_index``.
    """
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASSES[schedule])

    def stage(index: int):
        return types.SimpleNamespace(
            stage_index=index, num_stages=p * v, group_rank=index % p, group_size=p, submod=None
        )

    if schedule in ("gpipe", "1f1b"):
        sched = cls(stage(0), m)
    else:
        sched = cls([stage(k * p) for k in range(v)], m)  # rank 0's stages; order covers all
    kinds = {"F": "F", "B": "BW", "I": "B", "W": "W"}
    return tuple(
        tuple(
            (kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in sched.pipeline_order[r]
            if a is not None and a.computation_type.value in kinds
        )
        for r in range(p)
    )


GRID = [(p, v, m) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in (1, 2, 3, 4, 5, 6, 8, 9)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_constraints_match_torch_constructors(schedule):
    """check_schedule accepts exactly what torch's schedule class constructors accept."""
    for p, v, m in GRID:
        if schedule in ("gpipe", "1f1b") and v > 1:
            continue  # single-stage classes take one stage object; v > 1 is not expressible
        try:
            _torch_order(schedule, p, v, m)
            torch_ok = True
        except ValueError:
            torch_ok = False
        assert _valid(schedule, p, v, m) == torch_ok, (schedule, p, v, m)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_orders_match_torch_pipeline_order(schedule):
    """Our per-rank orders equal torch's pipeline_order (None idle slots and REDUCE_GRAD dropped).

    Exception: torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's
    forwards 1..m instead of 0..m-1 (an IR-only bug; ``_step_microbatches`` runs 0..m-1), so that
    rank is compared only once torch's IR has the right microbatches.
    """
    compared = 0
    for p, v, m in GRID:
        if not _valid(schedule, p, v, m):
            continue
        ours, theirs = action_order(schedule, p, v, m), _torch_order(schedule, p, v, m)
        for rank in range(p):
            torch_fwd = sorted(mb for kind, _, mb in theirs[rank] if kind == "F")
            if schedule == "1f1b" and torch_fwd != list(range(m)):
                assert rank == p - 1, (p, m, rank)  # the known bug affects only the last rank
                continue
            assert ours[rank] == theirs[rank], (schedule, p, v, m, rank)
            compared += 1
    assert compared > 20


# ---------------------------------------------------------------- uniform closed forms


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 5), (4, 4), (4, 8), (4, 13), (8, 16)])
def test_gpipe_and_1f1b_uniform_step_time(schedule, p, m):
    """[GPIPE]/[MEG]: step (m + p - 1)(f + b), idle share (p - 1)/(m + p - 1), ratio (p - 1)/m."""
    res = _uniform(schedule, p, 1, m)
    assert res.step_time_s == pytest.approx((m + p - 1) * (F + B), rel=EXACT)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=EXACT, abs=EXACT)
    assert res.bubble_ratio == pytest.approx(closed_form_bubble(schedule, p, 1, m), abs=EXACT)
    assert closed_form_bubble(schedule, p, 1, m) == pytest.approx((p - 1) / m, abs=EXACT)
    assert res.rank_busy_s == pytest.approx([m * (F + B)] * p, rel=EXACT)


@pytest.mark.parametrize(
    "p,v,m",
    [(2, 2, 2), (2, 3, 4), (4, 2, 4), (4, 2, 8), (4, 3, 12), (4, 2, 5), (4, 4, 10), (8, 2, 16)],
)
def test_interleaved_bubble_matches_megatron(p, v, m):
    """[MEG] 2.2: interleaving v chunks divides the 1F1B bubble by v: (p - 1)/(v m), m >= p.

    Includes torch's flex-PP cases (m = 5, 10 with p = 4) that are not multiples of p.
    """
    assert _valid("interleaved-1f1b", p, v, m)
    res = _uniform("interleaved-1f1b", p, v, m)
    assert closed_form_bubble("interleaved-1f1b", p, v, m) == pytest.approx((p - 1) / (v * m))
    assert res.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=SUMS)
    one_f_one_b = _uniform("1f1b", p, 1, m)
    if v > 1 and p > 1:
        assert res.step_time_s < one_f_one_b.step_time_s


def test_interleaved_fewer_microbatches_than_ranks():
    """Torch allows m < p for interleaved; each chunk wrap-around then idles p - m more slots."""
    for p, v, m in itertools.product((2, 3, 4, 8), (1, 2, 3, 4), range(1, 8)):
        if m >= p:
            continue
        expected = (p - 1 + (v - 1) * (p - m)) / (v * m)
        assert closed_form_bubble("interleaved-1f1b", p, v, m) == pytest.approx(expected)
        res = _uniform("interleaved-1f1b", p, v, m)
        assert res.bubble_ratio == pytest.approx(expected, rel=SUMS), (p, v, m)
        if v > 1:  # strictly worse than Megatron's formula, which assumes full rounds
            assert res.bubble_ratio > (p - 1) / (v * m)


def test_closed_form_rejects_zero_bubble():
    with pytest.raises(ValueError, match="simulate"):
        closed_form_bubble("zero-bubble", 4, 1, 8)


# ---------------------------------------------------------------- in-flight and memory


@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (4, 4), (4, 7), (8, 8), (8, 20)])
def test_in_flight_1f1b_and_gpipe(p, m):
    """[MEG] 2.2: 1F1B stage i holds min(p - i, m) microbatches; [GPIPE] holds all m."""
    assert in_flight("1f1b", p, 1, m) == tuple(min(p - i, m) for i in range(p))
    assert in_flight("gpipe", p, 1, m) == (m,) * p
    assert _uniform("1f1b", p, 1, m).peak_in_flight == in_flight("1f1b", p, 1, m)


def _rank_peak_chunks(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """Warmup forwards + 1 (the steady-state forward before the first backward), capped at v m."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)  # torch runs min(m, p - rank) forwards before the first backward
    per_round = m // max(1, m // p)
    factor = 2 if schedule == "interleaved-1f1b" else 1  # [TORCH] _get_warmup_ops
    warmup = (v - 1) * per_round + factor * (p - 1 - rank)
    return min(warmup + 1, v * m)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_peak_activation_bytes_consistent_with_in_flight(schedule):
    """Per-rank peak bytes: warmup-depth formula, and bounded by the per-stage peaks."""
    rng = random.Random(0)
    for p, v, m in GRID:
        if not _valid(schedule, p, v, m):
            continue
        act = [float(rng.randint(1, 9)) for _ in range(p * v)]  # integers: exact sums
        res = simulate(schedule, [F] * (p * v), [B] * (p * v), m, p, activation_bytes=act)
        ones = simulate(
            schedule, [F] * (p * v), [B] * (p * v), m, p, activation_bytes=[1.0] * (p * v)
        )
        assert res.peak_in_flight == in_flight(schedule, p, v, m)
        for r in range(p):
            mine = range(r, p * v, p)
            assert ones.peak_activation_bytes[r] == _rank_peak_chunks(schedule, p, v, m, r)
            upper = sum(res.peak_in_flight[s] * act[s] for s in mine)
            lower = max(res.peak_in_flight[s] * act[s] for s in mine)
            assert lower <= res.peak_activation_bytes[r] <= upper
            if v == 1:  # one stage per rank: exactly in_flight x bytes
                assert res.peak_activation_bytes[r] == res.peak_in_flight[r] * act[r]
    assert _uniform(schedule, 2, 1, 2).peak_activation_bytes == (0.0, 0.0)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 3), (3, 4, 6)])
def test_interleaved_memory_at_most_gpipe(p, v, m):
    """Interleaving keeps no more than GPipe per stage (m) and per rank (m x whole-rank bytes)."""
    act = [1.0 / v] * (p * v)  # the rank's model cut into v equal chunks
    fwd, bwd = [F / v] * (p * v), [B / v] * (p * v)
    inter = simulate("interleaved-1f1b", fwd, bwd, m, p, activation_bytes=act)
    gpipe = simulate("gpipe", [F] * p, [B] * p, m, p, activation_bytes=[1.0] * p)
    assert all(n <= m for n in inter.peak_in_flight)
    for r in range(p):
        assert inter.peak_activation_bytes[r] <= gpipe.peak_activation_bytes[r] + SUMS


# ---------------------------------------------------------------- zero bubble


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
@pytest.mark.parametrize("weight_fraction", [0.25, 0.5, 0.75])
def test_zero_bubble_beats_1f1b(p, m_per_p, weight_fraction):
    """[ZB]: moving W into the bubbles never slows the step, and shrinks the bubble for m >= p."""
    m = p * m_per_p
    zb = _uniform("zero-bubble", p, 1, m, weight_fraction=weight_fraction)
    ofob = _uniform("1f1b", p, 1, m)
    assert zb.step_time_s <= ofob.step_time_s
    assert zb.bubble_fraction < ofob.bubble_fraction
    assert zb.rank_busy_s == pytest.approx(ofob.rank_busy_s, rel=EXACT)  # same work, split
    without_w = _uniform("zero-bubble", p, 1, m, weight_fraction=0.0)
    assert without_w.step_time_s == pytest.approx(ofob.step_time_s, rel=EXACT)  # degenerates


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 24)])
@pytest.mark.parametrize("t_w", [0.25, 0.5, 1.0])
def test_zero_bubble_h1_bubble_size(p, m, t_w):
    """[ZB] 3.1: ZB-H1 (torch's ZB1P) bubble is (p - 1)(T_F + T_B - T_W) for T_F = T_B >= T_W.

    1F1B's is (p - 1)(T_F + T_B + T_W): with T_F = T_B = T_W it is cut to a third.
    """
    t_f = t_b = 1.0
    back = t_b + t_w
    zb = simulate("zero-bubble", [t_f] * p, [back] * p, m, p, weight_fraction=t_w / back)
    ofob = simulate("1f1b", [t_f] * p, [back] * p, m, p)
    ideal = m * (t_f + back)
    assert zb.step_time_s - ideal == pytest.approx((p - 1) * (t_f + t_b - t_w), rel=EXACT)
    assert ofob.step_time_s - ideal == pytest.approx((p - 1) * (t_f + back), rel=EXACT)


def test_zero_bubble_actions_split_backward():
    """Zero-bubble runs B then W per (stage, mb) with (1 - wf) and wf of the backward."""
    res = simulate("zero-bubble", [1.0] * 4, [4.0] * 4, 4, 2, weight_fraction=0.25)
    for rank_actions in res.actions:
        kinds = {a[0] for a in rank_actions}
        assert kinds == {"F", "B", "W"}
        for kind, stage, mb, start, end in rank_actions:
            assert end - start == {"F": 1.0, "B": 3.0, "W": 1.0}[kind]
            if kind == "W":
                b_end = next(a[4] for a in rank_actions if a[:3] == ("B", stage, mb))
                assert start >= b_end


# ---------------------------------------------------------------- p2p


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_p2p_adds_two_hops_per_boundary_at_one_microbatch(p):
    """m = 1: one microbatch goes down p - 1 boundaries and back up: + 2(p - 1) p2p_s.

    torch's Schedule1F1B refuses m < p, but at m = 1 its order (F then BW on every rank) is
    GPipe's; the public API is exercised through 'gpipe', the 1F1B order through its generator.
    """
    d = 0.25
    base = _uniform("gpipe", p, 1, 1)
    with_p2p = _uniform("gpipe", p, 1, 1, p2p_s=d)
    added = with_p2p.step_time_s - base.step_time_s
    assert added == pytest.approx(2 * (p - 1) * d, rel=EXACT, abs=EXACT)
    assert with_p2p.rank_busy_s == base.rank_busy_s  # p2p is latency, not busy time
    orders = [_one_f_one_b_order(r, p, 1) for r in range(p)]
    assert tuple(map(tuple, orders)) == action_order("gpipe", p, 1, 1)
    durations = {"F": [F] * p, "BW": [B] * p, "B": [B] * p, "W": [0.0] * p}
    timed, _ = _execute(orders, durations, p, d)
    assert max(a[4] for acts in timed for a in acts) == with_p2p.step_time_s


def test_p2p_1f1b_hand_case():
    """p = m = 2, f = 1, b = 2, p2p = 0.25, by hand.

    rank 0: F0 [0,1] F1 [1,2] . . . . . . BW0 [4.5,6.5] . BW1 [7.5,9.5]
    rank 1: F0 [1.25,2.25] BW0 [2.25,4.25] F1 [4.25,5.25] BW1 [5.25,7.25]
    (rank 1's F1 waits for its own BW0: 1F1B order; rank 0's BW1 waits 7.25 + 0.25).
    """
    res = simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 2, 2, p2p_s=0.25)
    assert res.step_time_s == 9.5
    spans = [(1.25, 2.25), (2.25, 4.25), (4.25, 5.25), (5.25, 7.25)]
    assert [a[3:] for a in res.actions[1]] == spans


def test_zero3_gathers_one_action_ahead_hand_cases():
    """ZeRO-3 in a pipeline (``gather_s``): each action's parameter gather is issued when the
    rank's gathering action before it starts (runtime.prefetch), the rank's first waited for at
    once. By hand, 1F1B, f = 1, b = 2:

    one rank, m = 2, g = 0.5: F0 [0.5,1.5] BW0 [1.5,3.5] F1 [3.5,4.5] BW1 [4.5,6.5]: only the
    first gather shows; g = 3: F0 [3,4] BW0 [6,8] F1 [9,10] BW1 [12,14]: every action lasts a
    gather. p = m = 2, g = 0.5, step 10 against 9 without gathers (each rank's first exposed,
    on the fill); waited for at once before every action, as the runtime did before the
    prefetch, the same step took (m + p - 1)(f + b + 2g) = 12.
    """
    one = simulate("1f1b", [1.0], [2.0], 2, 1, gather_s=[0.5])
    assert [a[3:] for a in one.actions[0]] == [(0.5, 1.5), (1.5, 3.5), (3.5, 4.5), (4.5, 6.5)]
    assert one.rank_busy_s == (6.0,)  # (the gathers are not compute)
    slow = simulate("1f1b", [1.0], [2.0], 2, 1, gather_s=[3.0])
    assert [a[3:] for a in slow.actions[0]] == [(3.0, 4.0), (6.0, 8.0), (9.0, 10.0), (12.0, 14.0)]
    two = simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 2, 2, gather_s=[0.5, 0.5])
    assert [a[3:] for a in two.actions[1]] == [(2.0, 3.0), (3.0, 5.0), (5.0, 6.0), (6.0, 8.0)]
    assert two.step_time_s == 10.0
    assert simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 2, 2).step_time_s == 9.0
    assert simulate("1f1b", [2.0, 2.0], [3.0, 3.0], 2, 2).step_time_s == 15.0  # (at once)
    # the weight step of a split backward gathers nothing
    zb = simulate("zero-bubble", [1.0] * 4, [2.0] * 4, 4, 2, gather_s=[0.25] * 4)
    plain = simulate("zero-bubble", [1.0] * 4, [2.0] * 4, 4, 2)
    assert plain.step_time_s < zb.step_time_s < plain.step_time_s + 2 * 0.25 * 2 * 4 * 2
    with pytest.raises(ValueError, match="gather_s"):
        simulate("1f1b", [1.0], [2.0], 2, 1, gather_s=[-1.0])


# ---------------------------------------------------------------- non-uniform stages


def test_non_uniform_hand_case():
    """p = m = 2, f = [1, 2], b = [2, 4] under 1F1B, by hand.

    rank 0: F0 [0,1] F1 [1,2] ... BW0 [7,9] ... BW1 [13,15]
    rank 1: F0 [1,3] BW0 [3,7] F1 [7,9] BW1 [9,13]      -> step 15
    """
    res = simulate("1f1b", [1.0, 2.0], [2.0, 4.0], 2, 2)
    assert res.actions[0] == (
        ("F", 0, 0, 0.0, 1.0),
        ("F", 0, 1, 1.0, 2.0),
        ("BW", 0, 0, 7.0, 9.0),
        ("BW", 0, 1, 13.0, 15.0),
    )
    assert res.step_time_s == 15.0
    assert res.rank_busy_s == (6.0, 12.0)
    assert res.bubble_fraction == pytest.approx(1 - 9.0 / 15.0, rel=EXACT)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_non_uniform_lower_bounds_and_dependencies(schedule):
    """Step >= m x slowest rank's per-microbatch work and >= one microbatch's full chain."""
    rng = random.Random(1)
    for p, v, m in [(2, 1, 4), (3, 1, 3), (4, 1, 8), (2, 2, 4), (4, 2, 8), (3, 3, 6)]:
        if not _valid(schedule, p, v, m):
            continue
        fwd = [rng.uniform(0.5, 2.0) for _ in range(p * v)]
        bwd = [rng.uniform(1.0, 4.0) for _ in range(p * v)]
        res = simulate(schedule, fwd, bwd, m, p, p2p_s=0.1)
        per_rank = [sum(fwd[s] + bwd[s] for s in range(r, p * v, p)) for r in range(p)]
        assert res.step_time_s >= m * max(per_rank) * (1 - SUMS)
        assert res.step_time_s >= (sum(fwd) + sum(bwd)) * (1 - SUMS)
        assert res.rank_busy_s == pytest.approx([m * t for t in per_rank], rel=SUMS)
        _assert_valid_timeline(res, p * v, p, m, 0.1)


def _assert_valid_timeline(res: ScheduleResult, stages: int, p: int, m: int, d: float) -> None:
    """Each (stage, mb) runs F and a backward once; ranks never overlap; dependencies hold."""
    end = {}
    for r, acts in enumerate(res.actions):
        for prev, cur in zip(acts, acts[1:]):
            assert cur[3] >= prev[4]
        for kind, s, mb, start, stop in acts:
            assert s % p == r
            end[("G" if kind in ("B", "BW") else kind, s, mb)] = (start, stop)
    assert len(end) >= 2 * stages * m
    for s, mb in itertools.product(range(stages), range(m)):
        hop = d if p > 1 else 0.0
        if s > 0:
            assert end[("F", s, mb)][0] >= end[("F", s - 1, mb)][1] + hop - SUMS
        if s < stages - 1:
            assert end[("G", s, mb)][0] >= end[("G", s + 1, mb)][1] + hop - SUMS
        assert end[("G", s, mb)][0] >= end[("F", s, mb)][1]


# ---------------------------------------------------------------- errors


def test_check_schedule_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'.*valid"):
        check_schedule("pipedream", 4, 1, 8)
    with pytest.raises(ValueError, match="virtual_stages=2.*use virtual_stages=1"):
        check_schedule("gpipe", 4, 2, 8)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        check_schedule("1f1b", 4, 2, 8)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1, got 0"):
        check_schedule("gpipe", 4, 1, 0)
    with pytest.raises(ValueError, match="ranks must be an int >= 1"):
        check_schedule("gpipe", 0, 1, 4)
    # torch: Schedule1F1B needs n_microbatches >= num_stages
    with pytest.raises(ValueError, match="microbatches=3 < ranks=4.*at least 4"):
        check_schedule("1f1b", 4, 1, 3)
    check_schedule("gpipe", 4, 1, 3)  # GPipe has no such limit
    # torch: interleaved / ZB need m % max(1, m // p) == 0
    for schedule in ("interleaved-1f1b", "zero-bubble"):
        msg = r"multiple of max\(1, microbatches // ranks\) = 2.*got microbatches=9"
        with pytest.raises(ValueError, match=msg):
            check_schedule(schedule, 4, 2, 9)
        for m in (1, 3, 4, 5, 7, 10, 12):
            check_schedule(schedule, 4, 2, m)


def test_simulate_input_errors():
    with pytest.raises(ValueError, match="len\\(forward_s\\)=3.*ranks=2"):
        simulate("gpipe", [1.0] * 3, [1.0] * 3, 2, 2)
    with pytest.raises(ValueError, match="len\\(backward_s\\)=1"):
        simulate("gpipe", [1.0] * 2, [1.0], 2, 2)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        simulate("1f1b", [1.0] * 4, [1.0] * 4, 2, 2)  # 4 stages on 2 ranks
    with pytest.raises(ValueError, match="forward_s must be finite and >= 0, got -1.0"):
        simulate("gpipe", [1.0, -1.0], [1.0, 1.0], 2, 2)
    with pytest.raises(ValueError, match="weight_fraction must be in \\[0, 1\\], got 1.5"):
        simulate("zero-bubble", [1.0] * 2, [1.0] * 2, 2, 2, weight_fraction=1.5)
    with pytest.raises(ValueError, match="p2p_s"):
        simulate("gpipe", [1.0] * 2, [1.0] * 2, 2, 2, p2p_s=-1.0)
    with pytest.raises(ValueError, match="activation_bytes must have one entry per stage \\(2\\)"):
        simulate("gpipe", [1.0] * 2, [1.0] * 2, 2, 2, activation_bytes=[1.0])


def test_deadlocking_order_raises():
    """Rank 0 wants BW0 before rank 1 can have run F0 (which needs rank 0's F0): stuck."""
    orders = [[("BW", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("BW", 1, 0)]]
    durations = {"F": [1.0, 1.0], "BW": [1.0, 1.0], "B": [1.0, 1.0], "W": [0.0, 0.0]}
    msg = r"deadlocks.*\(0, \('BW', 0, 0\)\).*\(1, \('F', 1, 0\)\)"
    with pytest.raises(RuntimeError, match=msg):
        _execute(orders, durations, 2, 0.0)


def test_result_is_frozen():
    res = _uniform("gpipe", 2, 1, 2)
    with pytest.raises(AttributeError):
        res.step_time_s = 0.0  # type: ignore[misc]

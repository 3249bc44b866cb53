"""Pipeline-parallel schedule simulator: step time, bubble and in-flight activations.

Model
-----
``p`` pipeline ranks each hold ``v`` model chunks ("virtual stages"), so the model is cut into
``S = p * v`` stages. Stage ``j`` lives on rank ``j % p`` (the looped placement of
``torch.distributed.pipelining``'s ``generate_stage_to_rank_mapping(style="loop")``). A step pushes
``m`` microbatches through every stage forward and then backward.

Every schedule is a fixed *per-rank order* of actions ``(kind, stage, microbatch)``:

* ``"F"``  forward of a stage on one microbatch;
* ``"BW"`` fused backward (input grad + weight grad), used by gpipe / 1f1b / interleaved-1f1b;
* ``"B"``  input-grad half of the backward and ``"W"`` weight-grad half, used by zero-bubble
  (torch calls these ``I`` and ``W``; torch's ``B`` is our fused ``"BW"``).

The orders (see :func:`action_order`) are the ones the schedule classes of
``torch.distributed.pipelining`` execute (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``), re-derived here in plain Python
so that the cost model neither imports ``torch.distributed`` nor touches its private ``_Action``
IR. The unit tests cross-check them against torch's own ``pipeline_order``.

:func:`simulate` is a dependency-driven list simulation: each rank runs its order strictly in
sequence, and an action starts at ``max(rank free, dependencies ready)`` where

* ``F(s, mb)`` needs ``F(s-1, mb)``;
* ``B``/``BW(s, mb)`` needs ``F(s, mb)`` and ``B``/``BW(s+1, mb)``;
* ``W(s, mb)`` needs ``B(s, mb)``;

and a dependency produced on another rank arrives ``p2p_s`` later (an activation / gradient
send). Sends are asynchronous with unbounded buffering (torch posts ``isend``/``irecv``), so p2p
time lengthens the critical path but never counts as busy time. Compute and communication of a
rank do not contend; the optimizer step and gradient reduction are not modelled. ZeRO-3's
parameter gathers (``gather_s``) are: each action that computes with a stage's parameters waits
for their gather, issued when the rank's previous such action started (``runtime.prefetch``).

Memory: a microbatch is *in flight* on a stage from the start of its forward until its input-grad
backward (``B`` or ``BW``) completes. Because all stages of a rank execute sequentially on that
rank, peaks depend only on the order, not on timing.

Sources:
  [GPIPE] Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
          Parallelism", NeurIPS 2019: fill-drain, step ``(m + p - 1)(f + b)``, all ``m``
          microbatches in flight.
  [MEG]   Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
          Megatron-LM", SC'21, section 2.2: 1F1B / PipeDream-Flush bubble fraction
          ``(p - 1) / m`` (bubble time over ideal time), interleaved ``(p - 1) / (v m)``; stage
          ``i`` of 1F1B keeps at most ``p - i`` microbatches in flight.
  [ZB]    Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024: split backward into B (input
          grad) and W (weight grad) and use W to fill bubbles (torch implements ZB-H1 / "ZB1P").
  [TORCH] torch/distributed/pipelining/schedules.py (checked against torch 2.13):
          ``Schedule1F1B._step_microbatches``, ``_get_1f1b_rank_ops``, ``_get_warmup_ops``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "SCHEDULES",
    "TORCH_SCHEDULE_CLASSES",
    "ScheduleResult",
    "check_schedule",
    "action_order",
    "in_flight",
    "peak_held_bytes",
    "held_until",
    "rank_memory",
    "closed_form_bubble",
    "simulate",
]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")

# Name of the torch.distributed.pipelining class each schedule models.
TORCH_SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}

_SINGLE_STAGE = ("gpipe", "1f1b")  # PipelineScheduleSingle subclasses: one stage per rank

Action = tuple[str, int, int]  # (kind, stage, microbatch)
TimedAction = tuple[str, int, int, float, float]  # (kind, stage, microbatch, start_s, end_s)


@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of :func:`simulate` for one training step.

    ``step_time_s``: time from the first action's start (0) to the last action's end.
    ``bubble_fraction``: ``1 - mean(rank_busy_s) / step_time_s`` (idle share of the step).
    ``rank_busy_s``: per rank, the summed duration of its compute actions.
    ``peak_in_flight``: per stage, the max number of microbatches whose forward ran and whose
    input-grad backward (``B``/``BW``) has not completed.
    ``peak_activation_bytes``: per rank, max over time of
    ``sum(in_flight[s] * activation_bytes[s])`` over the rank's stages (zeros when no
    ``activation_bytes`` were given).
    ``actions``: per rank, the executed ``(kind, stage, microbatch, start_s, end_s)`` in order.
    """

    step_time_s: float
    bubble_fraction: float
    rank_busy_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]
    actions: tuple[tuple[TimedAction, ...], ...]

    @property
    def bubble_ratio(self) -> float:
        """Bubble time over ideal (busy) time, ``step / mean busy - 1``: [MEG]'s definition."""
        mean_busy = sum(self.rank_busy_s) / len(self.rank_busy_s)
        if mean_busy == 0.0:
            return 0.0
        return self.step_time_s / mean_busy - 1.0


def _check_count(name: str, value: int, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}; {fix}")


def _rounds(ranks: int, microbatches: int) -> tuple[int, int]:
    """Torch's flex-PP rounds for interleaved schedules: ``(number_of_rounds, mb_per_round)``."""
    # [TORCH] ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble.__init__
    number_of_rounds = max(1, microbatches // ranks)
    return number_of_rounds, microbatches // number_of_rounds


def check_schedule(schedule: str, ranks: int, virtual_stages: int, microbatches: int) -> None:
    """Raise ``ValueError`` unless torch's schedule class accepts this configuration.

    Mirrors the constructor checks of torch 2.13: ``Schedule1F1B`` needs
    ``microbatches >= ranks`` (its ``num_stages``); ``ScheduleInterleaved1F1B`` and
    ``ScheduleInterleavedZeroBubble`` need ``microbatches % max(1, microbatches // ranks) == 0``;
    ``ScheduleGPipe`` accepts any ``microbatches >= 1``. GPipe and 1F1B hold exactly one stage per
    rank (``virtual_stages == 1``).
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}"
        )
    _check_count("ranks", ranks, "pass the pipeline-parallel group size")
    _check_count("virtual_stages", virtual_stages, "pass the number of model chunks per rank")
    _check_count("microbatches", microbatches, "pass the number of microbatches per step")
    if schedule in _SINGLE_STAGE and virtual_stages != 1:
        raise ValueError(
            f"schedule {schedule!r} ({TORCH_SCHEDULE_CLASSES[schedule]}) runs one stage per rank "
            f"but virtual_stages={virtual_stages} was given; use virtual_stages=1 or the "
            "'interleaved-1f1b' / 'zero-bubble' schedule"
        )
    if schedule == "1f1b" and microbatches < ranks:
        # [TORCH] Schedule1F1B.__init__: n_microbatches >= num_stages
        raise ValueError(
            f"schedule '1f1b' (Schedule1F1B) requires microbatches >= ranks, got "
            f"microbatches={microbatches} < ranks={ranks}; use at least {ranks} microbatches "
            "or the 'gpipe' schedule"
        )
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds, _ = _rounds(ranks, microbatches)
        if microbatches % rounds != 0:
            # [TORCH] "... requires the number of microbatches to be a multiple of the number
            # of rounds" with number_of_rounds = max(1, n_microbatches // pp_group_size)
            lower, upper = rounds * (microbatches // rounds), rounds * (microbatches // rounds + 1)
            raise ValueError(
                f"schedule {schedule!r} ({TORCH_SCHEDULE_CLASSES[schedule]}) requires "
                f"microbatches to be a multiple of max(1, microbatches // ranks) = {rounds}, got "
                f"microbatches={microbatches} with ranks={ranks}; use e.g. {lower} or {upper} "
                f"microbatches (any multiple of ranks={ranks} works)"
            )


def _gpipe_order(rank: int, microbatches: int) -> list[Action]:
    # [GPIPE] fill-drain; [TORCH] ScheduleGPipe: all forwards, then all backwards in mb order.
    return [("F", rank, mb) for mb in range(microbatches)] + [
        ("BW", rank, mb) for mb in range(microbatches)
    ]


def _one_f_one_b_order(rank: int, ranks: int, microbatches: int) -> list[Action]:
    # [TORCH] Schedule1F1B._step_microbatches: min(m, p - i) warmup forwards, then "1B1F" pairs,
    # then the remaining backwards. As a sequence this is [MEG]'s p - i - 1 warmup forwards
    # followed by 1F1B steady state and cooldown.
    warmup = min(microbatches, ranks - rank)
    order: list[Action] = [("F", rank, mb) for mb in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        order.append(("BW", rank, bwd))
        bwd += 1
        if fwd == microbatches:
            break
        order.append(("F", rank, fwd))
        fwd += 1
    order.extend(("BW", rank, mb) for mb in range(bwd, microbatches))
    return order


def _interleaved_order(
    rank: int, ranks: int, chunks: int, microbatches: int, zero_bubble: bool
) -> list[Action]:
    """One rank's order of ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble.

    Mirrors [TORCH] ``_get_warmup_ops`` and ``_get_1f1b_rank_ops`` (``None`` idle slots dropped:
    torch's runtime skips them and waits on receives instead).
    """
    _, per_round = _rounds(ranks, microbatches)
    total = chunks * microbatches  # forwards (and backwards) this rank runs
    # [TORCH] _get_warmup_ops: (v - 1) * mb_per_round + factor * (p - 1 - rank), capped at v*m;
    # factor 2 for interleaved 1F1B ([MEG] 2.2 uses (p - rank - 1) * 2 + (v - 1) * p), 1 for ZB.
    factor = 1 if zero_bubble else 2
    warmup = min((chunks - 1) * per_round + factor * (ranks - 1 - rank), total)

    def fwd_stage(op: int) -> int:
        return ((op // per_round) % chunks) * ranks + rank

    def bwd_stage(op: int) -> int:
        return (chunks - 1 - ((op - warmup) // per_round) % chunks) * ranks + rank

    order: list[Action] = []
    next_mb: dict[tuple[str, int], int] = {}

    def emit(kind: str, stage: int) -> None:
        mb = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = mb + 1
        order.append((kind, stage, mb))

    backward_kind = "B" if zero_bubble else "BW"
    backward_ops: list[int] = []
    for op in range(warmup):
        emit("F", fwd_stage(op))
    for op in range(warmup, total + warmup):  # steady state (F then B) and cooldown (B only)
        if op < total:
            emit("F", fwd_stage(op))
        emit(backward_kind, bwd_stage(op))
        backward_ops.append(op)
        # [TORCH] ZB1P: rank r lets r input-grad backwards run ahead of their weight grads.
        if zero_bubble and op - warmup >= rank:
            emit("W", bwd_stage(backward_ops[len(backward_ops) - 1 - rank]))
    if zero_bubble:
        done = max(0, len(backward_ops) - rank)
        for op in backward_ops[done:]:
            emit("W", bwd_stage(op))
    return order


def action_order(
    schedule: str, ranks: int, virtual_stages: int, microbatches: int
) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the ordered compute actions ``(kind, stage, microbatch)`` of ``schedule``.

    Kinds are ``"F"``, ``"BW"`` (fused backward), ``"B"`` (input grad) and ``"W"`` (weight grad);
    the orders are those torch's schedule classes execute (see the module docstring).
    """
    check_schedule(schedule, ranks, virtual_stages, microbatches)
    orders: list[list[Action]] = []
    for rank in range(ranks):
        if schedule == "gpipe":
            orders.append(_gpipe_order(rank, microbatches))
        elif schedule == "1f1b":
            orders.append(_one_f_one_b_order(rank, ranks, microbatches))
        else:
            zb = schedule == "zero-bubble"
            orders.append(_interleaved_order(rank, ranks, virtual_stages, microbatches, zb))
    return tuple(tuple(order) for order in orders)


def _peaks(
    orders: Sequence[Sequence[Action]], stages: int, activation_bytes: Sequence[float] | None,
    ends: tuple[str, ...] = ("B", "BW"),
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Per-stage peak in-flight microbatches and per-rank peak activation bytes of ``orders``
    (a microbatch is in flight from its ``F`` to its action of a kind in ``ends``)."""
    act = [0.0] * stages if activation_bytes is None else [float(a) for a in activation_bytes]
    count = [0] * stages
    peak = [0] * stages
    peak_bytes: list[float] = []
    for order in orders:
        live, rank_peak = 0.0, 0.0
        for kind, stage, _ in order:
            if kind == "F":
                count[stage] += 1
                live += act[stage]
                peak[stage] = max(peak[stage], count[stage])
                rank_peak = max(rank_peak, live)
            elif kind in ends:
                count[stage] -= 1
                live -= act[stage]
        peak_bytes.append(rank_peak)
    return tuple(peak), tuple(peak_bytes)


def in_flight(
    schedule: str, ranks: int, virtual_stages: int, microbatches: int, until: str = "B"
) -> tuple[int, ...]:
    """Per stage, the peak number of microbatches in flight (forward done, input grad not done;
    ``until="W"``: weight grad not done, which zero-bubble runs later than the input grad).

    Derived from :func:`action_order` alone. E.g. 1F1B stage ``i`` holds ``min(p - i, m)``
    ([MEG] 2.2), GPipe holds ``m`` ([GPIPE]).
    """
    if until not in ("B", "W"):
        raise ValueError(f"in_flight(until={until!r}): use 'B' (input grad) or 'W' (weight grad)")
    orders = action_order(schedule, ranks, virtual_stages, microbatches)
    return _peaks(orders, ranks * virtual_stages, None, ends=("W", "BW") if until == "W" else ("B", "BW"))[0]


def peak_held_bytes(
    schedule: str, ranks: int, virtual_stages: int, microbatches: int,
    per_microbatch_bytes: Sequence[float], until: str = "B",
) -> tuple[float, ...]:
    """Per rank, the most bytes its stages' microbatches in flight hold at one time, stage
    ``s`` holding ``per_microbatch_bytes[s]`` for each (``until`` as in :func:`in_flight`).
    Less than the sum of the stages' own peaks when those are not at the same time
    (interleaved and zero-bubble schedules)."""
    if until not in ("B", "W"):
        raise ValueError(f"peak_held_bytes(until={until!r}): use 'B' or 'W'")
    orders = action_order(schedule, ranks, virtual_stages, microbatches)
    return _peaks(orders, ranks * virtual_stages, per_microbatch_bytes,
                  ends=("W", "BW") if until == "W" else ("B", "BW"))[1]


def held_until(schedule: str) -> str:
    """Up to which action a microbatch's saved values are held (``until`` of
    :func:`in_flight`): zero-bubble's weight step (``W``), after the input gradients it sends
    back; otherwise the (fused) backward (``B``)."""
    return "W" if schedule == "zero-bubble" else "B"


def rank_memory(
    schedule: str, ranks: int, virtual_stages: int, microbatches: int,
    peak_bytes: Sequence[float], held_bytes: Sequence[float], per_microbatch_bytes: Sequence[float],
) -> tuple[float, ...]:
    """Per rank, the peak memory of its stages, from each stage's own peak, what it holds
    while another stage of its rank runs (``held_bytes``: training state, gradient sum, receive
    buffers, and its microbatches in flight at their most) and what each microbatch in flight
    holds: the held bytes apart from microbatches, plus the most the stages' microbatches hold
    at one time (:func:`peak_held_bytes`), plus the largest rest of one stage's peak (its
    working buffers, alive only while it computes; one stage of a rank computes at a time)."""
    until = held_until(schedule)
    flight = in_flight(schedule, ranks, virtual_stages, microbatches, until)
    in_flight_bytes = peak_held_bytes(schedule, ranks, virtual_stages, microbatches,
                                      per_microbatch_bytes, until)
    fixed, rest = [0.0] * ranks, [0.0] * ranks
    for j, (peak, held, per_mb) in enumerate(zip(peak_bytes, held_bytes, per_microbatch_bytes)):
        fixed[j % ranks] += held - flight[j] * per_mb
        rest[j % ranks] = max(rest[j % ranks], peak - held)
    return tuple(f + b + r for f, b, r in zip(fixed, in_flight_bytes, rest))


def closed_form_bubble(
    schedule: str, ranks: int, virtual_stages: int, microbatches: int
) -> float:
    """[MEG]'s bubble fraction (bubble time / ideal time) for uniform stages and no p2p time.

    ``(p - 1) / m`` for gpipe and 1f1b ([GPIPE], [MEG] 2.2) and ``(p - 1) / (v m)`` for
    interleaved-1f1b with ``m >= p`` ([MEG] 2.2). Torch's interleaved schedule also accepts
    ``m < p``; then each of the ``v - 1`` chunk wrap-arounds idles ``p - m`` more slots, giving
    ``((p - 1) + (v - 1)(p - m)) / (v m)``. Zero-bubble has no time-independent closed form (it
    depends on the W share of the backward, [ZB]); use :func:`simulate` for it.
    """
    check_schedule(schedule, ranks, virtual_stages, microbatches)
    if schedule == "zero-bubble":
        raise ValueError(
            "schedule 'zero-bubble' has no closed-form bubble independent of stage times (it "
            "depends on the weight-grad share of the backward); use simulate(...).bubble_ratio"
        )
    p, v, m = ranks, virtual_stages, microbatches
    # [MEG] 2.2: bubble time (p - 1)(t_f + t_b) / v over ideal time m (t_f + t_b).
    # m < p (torch flex-PP, one round of m microbatches): a microbatch group needs p slots to go
    # round the ring of ranks but fills only m, so every chunk boundary adds p - m idle slots
    # (derived here; the unit tests check it against simulate()).
    extra = (v - 1) * max(0, p - m)
    return (p - 1 + extra) / (v * m)


def _check_times(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    ranks: int,
    p2p_s: float,
    weight_fraction: float,
    activation_bytes: Sequence[float] | None,
) -> int:
    """Validate :func:`simulate`'s inputs and return ``virtual_stages``."""
    _check_count("ranks", ranks, "pass the pipeline-parallel group size")
    stages = len(forward_s)
    if stages == 0 or len(backward_s) != stages or stages % ranks != 0:
        raise ValueError(
            f"forward_s and backward_s must have the same length S = ranks * virtual_stages, got "
            f"len(forward_s)={stages}, len(backward_s)={len(backward_s)}, ranks={ranks}; pass one "
            "time per stage (a multiple of ranks)"
        )
    for name, values in (("forward_s", forward_s), ("backward_s", backward_s)):
        bad = [t for t in values if not (math.isfinite(t) and t >= 0)]
        if bad:
            raise ValueError(f"{name} must be finite and >= 0, got {bad[0]!r}; fix that stage time")
    if not (math.isfinite(p2p_s) and p2p_s >= 0):
        raise ValueError(f"p2p_s must be finite and >= 0, got {p2p_s!r}")
    if not 0.0 <= weight_fraction <= 1.0:
        raise ValueError(
            f"weight_fraction must be in [0, 1], got {weight_fraction!r}; it is the weight-grad "
            "share of each backward (about 0.5 for matmul-dominated stages)"
        )
    if activation_bytes is not None and len(activation_bytes) != stages:
        raise ValueError(
            f"activation_bytes must have one entry per stage ({stages}), got "
            f"{len(activation_bytes)}; pass per-stage bytes per microbatch or None"
        )
    return stages // ranks


def _ready_time(
    action: Action, done: dict[tuple[str, int, int], float], stages: int, ranks: int, p2p_s: float
) -> float | None:
    """When ``action``'s inputs are available, or ``None`` if a dependency has not run yet."""
    kind, stage, mb = action
    deps: list[tuple[tuple[str, int, int], bool]] = []  # (dependency, crosses ranks)
    if kind == "F":
        if stage > 0:
            deps.append((("F", stage - 1, mb), (stage - 1) % ranks != stage % ranks))
    elif kind in ("B", "BW"):
        deps.append((("F", stage, mb), False))
        if stage < stages - 1:
            deps.append((("G", stage + 1, mb), (stage + 1) % ranks != stage % ranks))
    else:  # "W"
        deps.append((("G", stage, mb), False))
    ready = 0.0
    for key, crosses in deps:
        if key not in done:
            return None
        ready = max(ready, done[key] + (p2p_s if crosses else 0.0))
    return ready


def _execute(
    orders: Sequence[Sequence[Action]],
    durations: dict[str, Sequence[float]],
    ranks: int,
    p2p_s: float,
    gather_s: Sequence[float] | None = None,
) -> tuple[tuple[tuple[TimedAction, ...], ...], tuple[float, ...]]:
    """Run each rank's order in sequence; return timed actions and busy time per rank.

    ``durations`` maps a kind to per-stage seconds. ``gather_s``: per stage, the seconds of
    the parameter gather each of its ``F``, ``B`` and ``BW`` actions waits for (ZeRO-3),
    issued when the rank's gathering action before it starts (``runtime.prefetch``); the
    rank's first is waited for at once. Raises ``RuntimeError`` if no rank can start its next
    action (the orders deadlock).
    """
    stages = len(durations["F"])
    done: dict[tuple[str, int, int], float] = {}  # "F"/"G" (input grad)/"W" -> end time
    timed: list[list[TimedAction]] = [[] for _ in range(ranks)]
    free, busy, pos = [0.0] * ranks, [0.0] * ranks, [0] * ranks
    issued: list[float | None] = [None] * ranks  # when the rank's pending gather was issued
    progress = True
    while progress:
        progress = False
        for rank in range(ranks):
            while pos[rank] < len(orders[rank]):
                kind, stage, mb = orders[rank][pos[rank]]
                ready = _ready_time((kind, stage, mb), done, stages, ranks, p2p_s)
                if ready is None:
                    break
                start = max(free[rank], ready)
                gather = gather_s[stage] if gather_s is not None and kind != "W" else 0.0
                if gather > 0.0:  # (its gather: issued one gathering action ahead, or now)
                    start = start + gather if issued[rank] is None else max(
                        start, issued[rank] + gather)
                    issued[rank] = start
                end = start + durations[kind][stage]
                key = ("G" if kind in ("B", "BW") else kind, stage, mb)
                if key in done or stage % ranks != rank:
                    raise RuntimeError(f"invalid action {(kind, stage, mb)} on rank {rank}")
                done[key] = end
                timed[rank].append((kind, stage, mb, start, end))
                free[rank] = end
                busy[rank] += end - start
                pos[rank] += 1
                progress = True
    stuck = [(r, orders[r][pos[r]]) for r in range(ranks) if pos[r] < len(orders[r])]
    if stuck:
        raise RuntimeError(
            "pipeline order deadlocks: no rank can start its next action; stuck (rank, action): "
            f"{stuck}"
        )
    return tuple(tuple(t) for t in timed), tuple(busy)


def simulate(
    schedule: str,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    microbatches: int,
    ranks: int,
    p2p_s: float = 0.0,
    weight_fraction: float = 0.5,
    activation_bytes: Sequence[float] | None = None,
    gather_s: Sequence[float] | None = None,
) -> ScheduleResult:
    """Simulate one step of ``schedule`` with per-stage, per-microbatch times.

    ``forward_s[s]`` / ``backward_s[s]``: seconds of stage ``s`` on one microbatch; their length
    ``S = ranks * virtual_stages`` fixes ``virtual_stages``. For zero-bubble each backward is split
    into ``B`` = ``(1 - weight_fraction) * backward_s[s]`` and ``W`` = ``weight_fraction *
    backward_s[s]`` ([ZB]); other schedules run one fused ``BW``. ``p2p_s`` delays every
    dependency that crosses ranks. ``activation_bytes[s]``: bytes stage ``s`` keeps per in-flight
    microbatch. ``gather_s[s]`` (ZeRO-3 in a pipeline): seconds of stage ``s``'s parameter
    gather before each of its forwards and (input-gradient) backwards, issued when the rank's
    gathering action before it starts, so that it overlaps that action (the rank's first
    gather of the step is exposed); not busy time.
    """
    chunks = _check_times(forward_s, backward_s, ranks, p2p_s, weight_fraction, activation_bytes)
    if gather_s is not None and (len(gather_s) != len(forward_s) or not all(
            math.isfinite(g) and g >= 0 for g in gather_s)):
        raise ValueError(f"gather_s must hold one finite, non-negative time per stage "
                         f"({len(forward_s)}), got {list(gather_s)!r}")
    orders = action_order(schedule, ranks, chunks, microbatches)
    wf = float(weight_fraction)
    durations: dict[str, Sequence[float]] = {
        "F": [float(t) for t in forward_s],
        "BW": [float(t) for t in backward_s],
        "B": [(1.0 - wf) * t for t in backward_s],
        "W": [wf * t for t in backward_s],
    }
    timed, busy = _execute(orders, durations, ranks, p2p_s, gather_s)
    step = max((a[4] for rank_actions in timed for a in rank_actions), default=0.0)
    peak, peak_bytes = _peaks(orders, len(forward_s), activation_bytes)
    bubble = 0.0 if step == 0.0 else 1.0 - (sum(busy) / ranks) / step
    return ScheduleResult(
        step_time_s=step,
        bubble_fraction=bubble,
        rank_busy_s=busy,
        peak_in_flight=peak,
        peak_activation_bytes=peak_bytes,
        actions=timed,
    )

"""The closed-form price of one training-step setup: :func:`price_setup`.

Owns :func:`price_setup` (the step time and per-rank memory of one candidate
:class:`~autopar.cost_models.training_step.Setup` from the per-layer costs
:class:`~autopar.cost_models.training_step.LayerCosts`, as a
:class:`~autopar.cost_models.training_step.StepCost`) and its parts: a unit's times and saved
bytes under recomputation and with its experts split over ep, the sums of each pipeline stage,
the memory per stage and per pipeline rank (training state under ZeRO, the step's buffers, the
backward's transient, ZeRO-3's gathered layers), the gradient reductions and ZeRO's gathers in
every microbatch or at the step's end, and the tensor-parallel collectives per stage. What it
reads and returns, the stages' split of the blocks (``blocks_per_stage``) and the optimizer's
time (``optimizer_step_time``) are :mod:`autopar.cost_models.training_step`'s, whose docstring
lists the sources cited here ([MEG], [SEL], [ZERO]).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from autopar.cost_models.comm import axis_collective_time
from autopar.cost_models.pipeline import in_flight
from autopar.cost_models.sharding import REGATHERED_LAYERS
from autopar.cost_models.topology import Topology
from autopar.cost_models.training_step import (
    LayerCosts, Setup, StepCost, UnitCosts, blocks_per_stage, optimizer_step_time,
)

__all__ = ["memory_floor", "price_setup"]


@functools.lru_cache(maxsize=4096)
def _flight(schedule: str, pp: int, v: int, m: int) -> tuple[int, ...]:
    """In-flight microbatches per stage; they stop growing past ``m = 2 p v`` (checked against
    the simulator for the shapes the search uses), which bounds the simulation's cost."""
    if schedule == "none":
        return (1,)
    cap = m if m <= 2 * pp * v else 2 * pp * v
    return in_flight(schedule, pp, v, cap)


def _block_parts(lc: LayerCosts, recompute: str) -> tuple[float, float, float]:
    """(forward s, backward s, saved bytes) of one block under ``recompute`` ([MEG], [SEL])."""
    b = lc.block
    if recompute == "full":  # the block's input, and its random values (never re-drawn)
        again = b.forward_s - b.expert_forward_s  # (MoE experts: not run again)
        return b.forward_s, b.backward_s + again, lc.input_bytes + b.random_bytes
    if recompute == "selective":
        return b.forward_s, b.backward_s + b.attention_forward_s, b.activation_bytes - b.attention_bytes
    return b.forward_s, b.backward_s, b.activation_bytes


def _pre_parts(lc: LayerCosts, recompute: str) -> tuple[float, float, float]:
    """(forward s, backward s, saved bytes) of ``pre`` under ``recompute``: its leading blocks
    (``LayerCosts.lead_blocks``) recompute as :func:`_block_parts` has a block do; the rest
    (embedding) is never recomputed and has no attention core."""
    u = lc.pre
    if recompute == "full" and lc.lead_blocks:
        return (u.forward_s, u.backward_s + lc.lead_forward_s, u.activation_bytes
                - lc.lead_activation_bytes + lc.lead_blocks * lc.input_bytes)
    if recompute in ("selective", "full"):
        return u.forward_s, u.backward_s + u.attention_forward_s, u.activation_bytes - u.attention_bytes
    return u.forward_s, u.backward_s, u.activation_bytes


# _expert_parallel's answers by (id of the layer costs, ep, stride, id of the topology), each
# with the two objects it was computed from (held, so that their ids cannot be reused while
# the entry lives; checked by identity): the search prices thousands of setups on a few
# LayerCosts, and the split is the same for every setup of one (ep, stride). Both are frozen
# dataclasses; a topology whose ``peak_flops`` dict were changed in place would be served a
# stale split (the sharding prices' memo assumes the same)
_EXPERT_SPLITS: dict[tuple[int, int, int, int], tuple[LayerCosts, Topology, LayerCosts]] = {}
_EXPERT_SPLITS_MAX = 512


def _expert_parallel(lc: LayerCosts, setup: Setup, topology: Topology) -> LayerCosts:
    """``lc`` with the experts split over ``setup.ep``: each unit holds 1/ep of its experts'
    parameters and state, and its forward and backward add their all-to-alls over the ep
    ranks (:func:`_ep_stride`), which run inside the experts op, serial with it. Their compute
    is unchanged: under uniform routing a rank's experts receive as many rows as it sends; they
    read 1/ep of the experts' weights."""
    if setup.ep == 1:
        return lc
    key = (id(lc), setup.ep, _ep_stride(setup), id(topology))
    hit = _EXPERT_SPLITS.get(key)
    if hit is not None and hit[0] is lc and hit[1] is topology:
        return hit[2]
    out = _split_experts(lc, setup.ep, _ep_stride(setup), topology)
    if len(_EXPERT_SPLITS) >= _EXPERT_SPLITS_MAX:
        _EXPERT_SPLITS.pop(next(iter(_EXPERT_SPLITS)))
    _EXPERT_SPLITS[key] = (lc, topology, out)
    return out


def _ep_stride(setup: Setup) -> int:
    """The rank stride of ``setup``'s ep axis: cut from dp, cp * tp (the axes inside it); the
    cp ranks (``ep_in_cp``), cp's stride: tp, or 1 with ``cp_inside_tp``."""
    if setup.ep_in_cp:
        return 1 if setup.cp_inside_tp else setup.tp
    return setup.cp * setup.tp


def _split_experts(lc: LayerCosts, e: int, stride: int, topology: Topology) -> LayerCosts:
    """:func:`_expert_parallel`'s ``lc`` over ``e`` ranks of the given stride."""
    skew = lc.expert_load_skew

    def split(u: UnitCosts) -> UnitCosts:
        # (the rows out and back at the busiest rank's load; the counts first, as they are)
        a2a = lambda bs: sum(axis_collective_time("all_to_all", b * (skew if i else 1.0), e,  # noqa: E731
                                                  stride, topology) for i, b in enumerate(bs))
        f, b = a2a(u.expert_forward_bytes), a2a(u.expert_backward_bytes)
        # (the busiest rank's experts, reading 1/ep of the weights: priced at ep = 1, again)
        fw, bw = (w.skewed(skew).seconds(topology, 1 / e) - w.seconds(topology)
                  for w in (u.expert_forward_work, u.expert_backward_work))
        return dataclasses.replace(
            u, forward_s=u.forward_s + f + fw, backward_s=u.backward_s + b + bw,
            forward_comm_s=u.forward_comm_s + f, backward_comm_s=u.backward_comm_s + b,
            expert_forward_s=u.expert_forward_s + f + fw,
            expert_forward_comm_s=u.expert_forward_comm_s + f,
            state_bytes=u.state_bytes - u.expert_state_bytes * (1 - 1 / e),
            param_elements=u.param_elements - u.expert_elements * (1 - 1 / e),
            expert_elements=u.expert_elements / e, expert_state_bytes=u.expert_state_bytes / e)

    return dataclasses.replace(lc, pre=split(lc.pre), block=split(lc.block), post=split(lc.post))


def price_setup(lc: LayerCosts, setup: Setup, topology: Topology, budget_bytes: float) -> StepCost:
    """Step time and per-rank memory of ``setup`` from the per-layer costs ``lc``."""
    lc = _expert_parallel(lc, setup, topology)
    p, v, m = setup.pp, setup.virtual_stages, setup.microbatches
    stages = p * v
    bf, bb, bact = _block_parts(lc, setup.recompute)
    pf, pb, pact = _pre_parts(lc, setup.recompute)
    if setup.even_split:
        counts = tuple(lc.num_blocks // stages + (j < lc.num_blocks % stages) for j in range(stages))
    else:
        counts = blocks_per_stage(lc.num_blocks, stages, pf + pb,
                                  lc.post.forward_s + lc.post.backward_s, bf + bb)
    # the pipeline axis is outermost (stride dp * cp * tp): sends cross nodes on a cluster
    send = axis_collective_time("send_recv", lc.boundary_bytes, p, setup.dp * setup.cp * setup.tp,
                                topology) if p > 1 else 0.0
    sums = _stage_sums(lc, counts, send, (bf, bb, bact), (pf, pb, pact), setup)
    fw, bw, elems, xelems = sums.fw, sums.bw, sums.elems, sums.xelems
    if setup.grad_sync == "microbatch" and p > 1 and setup.dp > 1:
        fw, bw = _sync_per_microbatch(lc, setup, sums, topology)
    exposed = 0.0  # ZeRO-3: each rank's first gather of the step, waited for at once
    if setup.grad_sync == "regathered" and p > 1 and setup.dp > 1:  # ZeRO-3's gathers
        fw, bw, exposed = _gather_per_microbatch(setup, sums, topology)
    rank = lambda xs: [sum(xs[r::p]) for r in range(p)]  # noqa: E731  (a rank's stages)
    busy = [f + b for f, b in zip(rank(fw), rank(bw))]
    # [MEG] Eq. 1 generalised to unequal stages: m rounds of the busiest rank, plus the fill
    # and drain of p - 1 stage-times (a stage is 1/v of a rank's work when interleaved)
    chunk = max(f + b for f, b in zip(fw, bw))
    pipe = m * max(busy) + (p - 1) * chunk + p * exposed
    experts = _expert_setup(setup)  # (the experts' state: sharded over the dp / ep ranks)
    stage_memory, memory = _memory(lc, setup, counts, sums, bact)
    comm = m * max(rank(_comm_per_stage(lc, counts, setup.recompute)))
    per_rank = rank(elems)  # (the rank holding the most parameters)
    held = max(range(p), key=per_rank.__getitem__)
    x, xg = sum(xelems[held::p]), sum(sums.xgathered[held::p])
    dp_s, tied_s, opt_s = _step_end(lc, _dense_setup(setup), per_rank[held] - x,
                                    sum(sums.gathered[held::p]) - xg, topology)
    if x:  # the experts' gradients, over the ranks holding the same experts
        dp_x, _, opt_x = _step_end(lc, experts, x, xg, topology,
                                   outer=1 if setup.ep_in_cp else setup.ep, tied=False)
        dp_s, opt_s = dp_s + dp_x, opt_s + opt_x
    if setup.grad_sync == "microbatch" and p > 1:
        dp_s = 0.0  # reduced inside every microbatch's backward (in fw, bw above)
    parts = {"pipeline_s": pipe, "bubble_s": pipe - m * max(busy), "dp_comm_s": dp_s,
             "tied_grad_s": tied_s, "optimizer_s": opt_s, "tp_comm_s": comm,
             "p2p_s": m * 2 * send if p > 1 else 0.0}
    return StepCost(setup, pipe + dp_s + tied_s + opt_s, parts, counts,
                    tuple(f + b for f, b in zip(fw, bw)), tuple(memory), budget_bytes,
                    tuple(stage_memory), tuple(fw))


def memory_floor(lc: LayerCosts, setup: Setup, topology: Topology) -> float:
    """A lower bound of :func:`price_setup`'s largest per-rank memory, without pricing: the
    training state alone (:func:`_state_memory`, the experts' over their own ranks), averaged
    over the pipeline ranks. It holds for any split of the blocks into stages: a rank's memory
    is its stages' state plus buffers, peaks and gathered copies, all at least zero, and the
    largest is at least the mean; the state of a stage is linear in its parameters' bytes, so
    the stages' sum is the state of the whole model (a stage holding ``pre`` and ``post``
    counts the tied weight once). Lets the search drop setups whose state alone is over the
    budget (most of those that do not fit at scale) at a hundredth of a pricing's cost."""
    lc = _expert_parallel(lc, setup, topology)
    units = (lc.block, lc.pre, lc.post)
    counts = (lc.num_blocks, 1, 1)
    total = lambda field: sum(n * getattr(u, field) for n, u in zip(counts, units))  # noqa: E731
    tied = setup.pp * setup.virtual_stages == 1  # (one stage holds pre and post)
    widths = [u.gathered_bytes(lc.param_itemsize) for u in units]
    xstate, xgathered = total("expert_state_bytes"), sum(n * w[1] for n, w in zip(counts, widths))
    state = total("state_bytes") - tied * lc.tied_state_bytes - xstate
    gathered = sum(n * w[0] for n, w in zip(counts, widths)) \
        - tied * lc.tied_elements * lc.param_itemsize
    return (_state_memory(lc, _dense_setup(setup), state, gathered)
            + _state_memory(lc, _expert_setup(setup), xstate, xgathered)) / setup.pp


@dataclass(frozen=True)
class _StageSums:
    """Per stage: forward and backward seconds, saved bytes per microbatch, training-state
    bytes, parameter elements and the bytes ZeRO gathers of them, and of those the experts'."""

    fw: list[float]
    bw: list[float]
    act: list[float]
    state: list[float]
    elems: list[float]
    gathered: list[float]
    xstate: list[float]
    xelems: list[float]
    xgathered: list[float]


def _stage_sums(lc: LayerCosts, counts: tuple[int, ...], send: float,
                block: tuple[float, float, float], pre: tuple[float, float, float],
                setup: Setup) -> _StageSums:
    """The sums of each stage (``counts`` blocks each; ``pre`` on the first, ``post`` on the
    last, the boundary's ``send`` on both sides of each cut); ``block`` and ``pre``: their
    (forward s, backward s, saved bytes) under the setup's recomputation
    (:func:`_block_parts`, :func:`_pre_parts`)."""
    (bf, bb, bact), (pf, pb, pact) = block, pre
    stages = len(counts)
    widths = [u.gathered_bytes(lc.param_itemsize) for u in (lc.block, lc.pre, lc.post)]
    sums: dict[tuple[int, bool, bool], tuple[float, ...]] = {}  # (the stages alike: one sum)
    rows = []
    for j, n in enumerate(counts):
        first, last = j == 0, j == stages - 1
        if (n, first, last) not in sums:
            parts = [(k * g, k * x) for k, (g, x) in zip((n, first, last), widths)]
            shared = first and last  # pre and post on one stage hold the tied weight once
            sums[(n, first, last)] = (
                n * bf + first * pf + last * lc.post.forward_s + (not last) * send,
                n * bb + first * pb + last * lc.post.backward_s + (not first) * send,
                n * bact + first * pact + last * lc.post.activation_bytes
                - _regathered_saved(lc, setup, n, first, last),
                n * lc.block.state_bytes + first * lc.pre.state_bytes
                + last * lc.post.state_bytes - shared * lc.tied_state_bytes,
                n * lc.block.param_elements + first * lc.pre.param_elements
                + last * lc.post.param_elements - shared * lc.tied_elements,
                sum(g + x for g, x in parts) - shared * lc.tied_elements * lc.param_itemsize,
                n * lc.block.expert_state_bytes + first * lc.pre.expert_state_bytes
                + last * lc.post.expert_state_bytes,
                n * lc.block.expert_elements + first * lc.pre.expert_elements
                + last * lc.post.expert_elements,
                sum(x for _, x in parts))
        rows.append(sums[(n, first, last)])
    fw, bw, act, state, elems, gathered, xstate, xelems, xgathered = map(list, zip(*rows))
    return _StageSums(fw, bw, act, state, elems, gathered, xstate, xelems, xgathered)


def _regathered_saved(lc: LayerCosts, setup: Setup, blocks: int, first: bool, last: bool
                      ) -> float:
    """Saved bytes of the parameters' copies (autocast's casts) that a plan without a pipeline
    does not keep under ZeRO, of ``blocks`` blocks (and ``pre`` when ``first``, ``post`` when
    ``last``): ZeRO-3 makes them again for the backward; ZeRO-1 and 2 cast the shard and
    gather the cast, held once as the gathered copy (:func:`_state_memory`). A pipeline stage's
    program casts the gathered parameters again for each microbatch and saves those copies.
    None are kept by full recomputation's blocks anyway; the leading blocks' are counted as
    kept, erring high."""
    if not setup.zero or setup.shard == 1 or setup.pp > 1:
        return 0.0
    full = setup.recompute == "full"
    return ((not full) * blocks * lc.block.regathered_bytes
            + (first and not (full and lc.lead_blocks)) * lc.pre.regathered_bytes
            + last * lc.post.regathered_bytes)


def _memory(lc: LayerCosts, setup: Setup, counts: tuple[int, ...], s: _StageSums,
            bact: float) -> tuple[list[float], list[float]]:
    """Bytes per stage and per pipeline rank (the sum of its ``v`` stages): training state
    (the experts' sharded over the ranks holding the same experts), the step's buffers
    (:func:`_step_buffers`), one block's recomputed values while its backward runs (a stage
    holding blocks), and ZeRO-3's gathered parameters (in a pipeline, the computing stage's:
    once per rank, and in each stage's own memory); a backward transient (``_transient``) and,
    in a pipeline, the gradients being made once per rank, of the stage where they are largest
    (one stage of a rank computes at a time); ``bact``: one block's saved bytes
    (:func:`_block_parts`)."""
    p, stages = setup.pp, len(counts)
    flight = _flight(setup.schedule, p, setup.virtual_stages, setup.microbatches)
    peak = [lc.block.peak(setup.recompute) * (counts[j] > 0) for j in range(stages)]
    if lc.lead_blocks:  # (the first stage's leading blocks recompute too)
        peak[0] = max(peak[0], lc.pre.peak(setup.recompute))
    experts, dense = _expert_setup(setup), _dense_setup(setup)
    buffers = [[_step_buffers(lc, setup, j, s.act[j], flight[j], s.elems[j], s.xelems[j], t, b)
                for t, b in ((0.0, False), (_transient(lc, setup, counts, j, bact), True))]
               for j in range(stages)]
    base = [_state_memory(lc, dense, s.state[j] - s.xstate[j],
                          s.gathered[j] - s.xgathered[j])
            + _state_memory(lc, experts, s.xstate[j], s.xgathered[j])
            + buffers[j][0] + peak[j] for j in range(stages)]
    if setup.zero == 3 and setup.dp > 1 and p == 1:  # the gathered layers, one unreduced grad
        base = [m + _regathered_bytes(lc) for m in base]
    extra = [with_t - without for without, with_t in buffers]
    stage_memory = [b + e for b, e in zip(base, extra)]
    memory = [sum(base[r::p]) + max(extra[r::p]) for r in range(p)]
    if setup.zero == 3 and setup.dp > 1 and p > 1:
        # the computing stage's gathered parameters and the next action's gather in flight,
        # its flat buffer and packed shards (runtime.prefetch; one stage of a rank computes at
        # a time, the others hold no gathered copy)
        ahead = 2 + 1 / dense.shard
        # (experts on ranks of their own, dp = ep, are not sharded: no gathered copy of them)
        held = s.gathered if experts.shard > 1 else [g - x for g, x in zip(s.gathered,
                                                                           s.xgathered)]
        memory = [mem + ahead * max(held[j] for j in range(r, stages, p))
                  for r, mem in enumerate(memory)]
        # (and each stage's peak, while it computes: planning.pipeline.stage_budgets)
        stage_memory = [m + ahead * g for m, g in zip(stage_memory, held)]
    return stage_memory, memory


def _transient(lc: LayerCosts, setup: Setup, counts: tuple[int, ...], j: int,
               block_act: float) -> float:
    """What stage ``j``'s backward holds at its highest beyond one microbatch's saved values
    (``UnitCosts.backward_transient_bytes``): the backward runs ``post`` first, with every
    value saved, then the blocks, with ``post``'s freed, then ``pre``, with the blocks'
    freed too (``block_act``: one block's saved bytes; both as the stage's sum counts them)."""
    last = j == len(counts) - 1
    post = last * lc.post.activation_bytes - _regathered_saved(lc, setup, 0, False, last)
    blocks = counts[j] * block_act - _regathered_saved(lc, setup, counts[j], False, False)
    return max(0.0, last * lc.post.backward_transient_bytes,
               (counts[j] > 0) * lc.block.backward_transient_bytes - post,
               (j == 0) * lc.pre.backward_transient_bytes - post - blocks)


def _step_buffers(lc: LayerCosts, setup: Setup, j: int, act: float, flight: int,
                  elements: float, expert_elements: float = 0.0, transient: float = 0.0,
                  backward: bool = True) -> float:
    """The buffers stage ``j`` holds beside its training state, as the per-operator memory
    model counts them (``cost_models.liveness``): its saved values for ``flight`` microbatches
    in flight with a ``transient`` of the backward (:func:`_transient`), or, at the end of a
    microbatch's backward, those of the others and the gradients the backward made (whichever
    is more: the backward frees one as it makes the other). A pipeline stage's forward and
    backward are two graphs, so the saved values its backward reads are held until it returns,
    beside the gradients it makes and its transient (an upper bound: the transient's op comes
    before the last gradients; ``liveness._Walk.peak`` holds them so too), counted only with
    ``backward`` (the stage computing: once per rank, as the per-operator model adds one
    stage's step to the others' held bytes); in a pipeline also
    the sum of the earlier microbatches' gradients (``runtime.autograd.GradSink``) and the receive buffers
    torch's pipelining keeps per microbatch for the stage's incoming activation (all but the
    first stage) and incoming gradient (all but the last), one block input each. Without a pipeline a ZeRO step's
    gradients are reduce-scattered as they are made: the rank keeps its shard (of the
    ``expert_elements``' gradients, its shard among the ranks holding the same experts)."""
    grads = elements * lc.param_itemsize
    if setup.pp == 1:
        if setup.zero and setup.dp > 1:
            grads = ((elements - expert_elements) / setup.shard
                     + expert_elements / _expert_setup(setup).shard) * lc.param_itemsize
        return max(act * flight + transient, act * (flight - 1) + grads)
    saved = act * flight + (transient + grads if backward else 0.0)
    stages = setup.pp * setup.virtual_stages
    sink = grads if setup.microbatches > 1 else 0.0
    receive = setup.microbatches * lc.input_bytes * ((j > 0) + (j < stages - 1))
    return saved + sink + receive


def _sync_per_microbatch(lc: LayerCosts, setup: Setup, s: _StageSums, topology: Topology
                         ) -> tuple[list[float], list[float]]:
    """Stage times when every microbatch reduces the stage's gradients over dp in its backward
    (all-reduce; ZeRO-1: reduce-scatter, with the parameters all-gathered in every forward), as
    the runtime runs them (:mod:`autopar.passes.overlap`, priced per operator by
    :mod:`autopar.cost_models.overlap`): a ZeRO parameter is gathered where it is used and
    waited for at once, so the gathers add to the forward; the gradient reductions are issued
    when their gradients exist and hide behind the rest of the backward, unless tensor
    parallelism's collectives, needed at once, queue behind them on the rank's one
    communication channel (tp > 1), when they add to the backward too."""
    out_f, out_b = [], []
    for f, b, n, g in zip(s.fw, s.bw, s.elems, s.gathered):
        nbytes = n * lc.param_itemsize  # (the gradients, in the parameters' dtype)
        if setup.zero:
            gather = axis_collective_time("all_gather", g, setup.dp, setup.cp * setup.tp, topology)
            reduce = axis_collective_time("reduce_scatter", nbytes, setup.dp, setup.cp * setup.tp, topology)
        else:
            gather = 0.0
            reduce = axis_collective_time("all_reduce", nbytes, setup.dp, setup.cp * setup.tp, topology)
        out_f.append(f + gather)
        out_b.append(b + reduce if setup.tp > 1 else max(b, reduce))
    return out_f, out_b


def _gather_per_microbatch(setup: Setup, s: _StageSums, topology: Topology
                           ) -> tuple[list[float], list[float], float]:
    """Stage times when a ZeRO-3 pipeline stage gathers its parameters for every microbatch's
    forward and again for its backward (``runtime.pipeline``: one flat all-gather over the
    shard group each; with dp cut into (dp / ep, ep), one for the dense weights over ep and one
    for the experts over dp), each gather issued when the rank's action before it starts
    (``runtime.prefetch``): an action then lasts at least the next one's gather, taken as
    its own stage's. Also the longest gather: each rank's first of the step is waited for at
    once, after its first input arrives (on the pipeline's fill)."""
    out_f, out_b, most = [], [], 0.0
    experts, dense, inner = _expert_setup(setup), _dense_setup(setup), setup.cp * setup.tp
    # (with dp cut into (dp / ep, ep): the experts' over their own replicas, ep groups apart,
    # in their own bucket, as :func:`_step_end` strides them)
    stride = inner * setup.ep
    for f, b, g, xg in zip(s.fw, s.bw, s.gathered, s.xgathered):
        # (the dense weights over their shard group: _dense_setup)
        if setup.ep == 1 or setup.ep_in_cp:  # (one bucket, over dp)
            gather = axis_collective_time("all_gather", g, setup.shard, inner, topology)
        else:
            gather = (axis_collective_time("all_gather", g - xg, dense.shard,
                                           inner, topology)
                      + axis_collective_time("all_gather", xg, experts.shard, stride, topology))
        out_f.append(max(f, gather))
        out_b.append(max(b, gather))
        most = max(most, gather)
    return out_f, out_b, most


def _expert_setup(setup: Setup) -> Setup:
    """The setup the experts' parameters see: replicated (and ZeRO-sharded) over the dp / ep
    ranks that hold the same experts; with the ep ranks taken from cp, over dp, and not
    reduced over cp (split there): priced as a setup without cp whose dp ranks lie cp * tp
    apart (a tp of cp * tp)."""
    if setup.ep == 1:
        return setup
    if setup.ep_in_cp:
        return dataclasses.replace(setup, cp=1, tp=setup.cp * setup.tp, ep=1, ep_in_cp=False,
                                   cp_inside_tp=False)
    return dataclasses.replace(setup, dp=setup.dp // setup.ep, ep=1, dp_shard=0)


def _dense_setup(setup: Setup) -> Setup:
    """The setup the other (dense) parameters see: ``setup``, but in a pipeline with ZeRO and
    dp cut into (dp / ep, ep) they are sharded over the ep ranks only and replicated across
    the ep groups (a stage gathers and reduce-scatters its parameters over one axis:
    ``sharding.zero_once_placement``), priced as hybrid sharding with shard groups of ep."""
    if setup.zero and setup.pp > 1 and 1 < setup.ep < setup.dp and not setup.ep_in_cp:
        return dataclasses.replace(setup, dp_shard=setup.ep)
    return setup


def _step_end(lc: LayerCosts, setup: Setup, elements: float, gathered: float,
              topology: Topology, outer: int = 1, tied: bool = True
              ) -> tuple[float, float, float]:
    """Seconds of what follows the pipeline once per step: the data-parallel gradient reduction,
    the tied weight's gradient sum (``tied``) and the optimizer, for the rank holding
    ``elements`` (``gathered`` bytes of them as ZeRO gathers them); ``outer``: the dp ranks lie
    that many times further apart (the experts' replicas, across the ep groups)."""
    grad_bytes = elements * lc.param_itemsize
    stride = setup.cp * setup.tp * outer  # of the dp axis
    # one gradient reduction per step over dp (stride tp); ZeRO-1 does it as reduce-scatter plus
    # all-gather of the parameters, the same bytes ([ZERO]); hybrid sharding reduce-scatters
    # within its shard group (stride tp) and all-reduces the shard across the groups
    # (stride dp_shard * tp): FSDP2's HSDP
    if setup.zero:  # ZeRO-3 gathers the parameters again for the backward ([ZERO] sec. 7.2.2);
        # in a pipeline, for every microbatch (in its stage times: _gather_per_microbatch)
        gathers = 0 if setup.grad_sync == "regathered" else 2 if setup.zero == 3 else 1
        g = setup.shard
        dp_s = (axis_collective_time("reduce_scatter", grad_bytes, g, stride, topology)
                + gathers * axis_collective_time("all_gather", gathered, g, stride, topology))
        if g < setup.dp:
            dp_s += axis_collective_time("all_reduce", grad_bytes / g, setup.dp // g,
                                         g * stride, topology)
    else:
        dp_s = axis_collective_time("all_reduce", grad_bytes, setup.dp, stride, topology)
    if setup.cp > 1:  # each cp rank's gradients are partial sums over its sequence chunk,
        # all-reduced over cp once a step (the layer ILP leaves them partial there:
        # LayerSolver.costs); a pipeline stage sums them over its microbatches first and, with
        # ZeRO, reduces its dp shard only (step_end_buckets: the first axis, then the others)
        scattered = setup.shard if setup.zero and setup.pp > 1 else 1
        dp_s += axis_collective_time("all_reduce", grad_bytes / scattered, setup.cp,
                                     1 if setup.cp_inside_tp else setup.tp, topology)
    tied_s = 0.0
    if tied and setup.pp > 1 and lc.tied_elements:  # the first and last stage sum the tied weight's grad
        tied_s = axis_collective_time("all_reduce", lc.tied_elements * lc.param_itemsize, 2,
                                      setup.dp * setup.cp * setup.tp, topology)
    opt_s = optimizer_step_time(elements / (setup.shard if setup.zero else 1), lc.optimizer, topology)
    return dp_s, tied_s, opt_s


def _comm_per_stage(lc: LayerCosts, counts: tuple[int, ...], recompute: str) -> list[float]:
    """Collective seconds per stage and microbatch (recomputation repeats the forward's)."""
    b = lc.block
    per_block = b.forward_comm_s + b.backward_comm_s + \
        (recompute == "full") * (b.forward_comm_s - b.expert_forward_comm_s)
    out = []
    for j, n in enumerate(counts):
        out.append(n * per_block + (j == 0) * (lc.pre.forward_comm_s + lc.pre.backward_comm_s)
                   + (j == len(counts) - 1) * (lc.post.forward_comm_s + lc.post.backward_comm_s))
    return out


def _state_memory(lc: LayerCosts, setup: Setup, state: float, gathered: float) -> float:
    """Bytes of training state a rank keeps for a stage holding ``state`` bytes of parameters,
    gradients and optimizer states without ZeRO (``gathered``: the bytes of its parameters as
    ZeRO gathers them).

    ZeRO-1 as Megatron-LM's distributed optimizer runs it (``grad_sync="step"``): the optimizer
    part over dp, 6 + 12/d of 18 bytes in mixed precision ([ZERO] sec. 5.1). As autopar's
    runtime runs it (``grad_sync="gathered"`` or ``"microbatch"``): every parameter stored
    sharded over dp with its gradient and optimizer states (a ``Shard`` DTensor, as FSDP2), plus
    the copy gathered for the step's compute (priced so per operator:
    :mod:`autopar.cost_models.sharding`)."""
    if not setup.zero or setup.dp == 1:
        return state
    if setup.zero == 3:  # everything sharded; the gathered layers: _regathered_bytes
        return state / setup.shard
    if setup.grad_sync in ("gathered", "microbatch"):
        return state / setup.shard + gathered
    if lc.param_itemsize >= 4:
        total, opt = (16, 8) if lc.optimizer == "adam" else (8, 0)
    else:
        total, opt = (18, 12) if lc.optimizer == "adam" else (10, 4)
    return state * (total - opt + opt / setup.shard) / total


def _regathered_bytes(lc: LayerCosts) -> float:
    """What ZeRO-3 holds beside the sharded state: the gathered parameters of
    :data:`~autopar.cost_models.sharding.REGATHERED_LAYERS` units (the one computing, the
    one gathered ahead), the flat buffer a unit's copies are made from (``passes.
    gather_buckets``) and the unreduced gradient of one, at the largest unit's size
    ([ZERO] sec. 5.3; Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3.3 and 4.1)."""
    units = (lc.pre, lc.block, lc.post)
    gathered = max(sum(u.gathered_bytes(lc.param_itemsize)) for u in units)
    return ((REGATHERED_LAYERS + 1) * gathered
            + max(u.param_elements for u in units) * lc.param_itemsize)

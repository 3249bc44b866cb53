"""What the price of a whole training step reads and returns: per-layer costs, setups, the
priced step (pipeline, recomputation, ZeRO, data parallelism and the optimizer).

The per-layer costs (:class:`UnitCosts`) come from the intra-operator ILP solved on one layer of
the model (see :mod:`autopar.planning.search`);
:func:`~autopar.cost_models.step_price.price_setup` composes them for one candidate setup
(:class:`Setup`) into a step time and a per-rank memory (:class:`StepCost`), with closed forms
cheap enough to evaluate thousands of setups. This module owns what those closed forms read and
return, the stages' split of the blocks (:func:`blocks_per_stage`) and the optimizer's time
(:func:`optimizer_step_time`); :mod:`autopar.cost_models.step_price` owns the pricing.

Sources:
  [MEG]  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
         Megatron-LM", SC'21, arXiv:2104.04473: Eq. 1, batch time ``(m + p - 1)(t_f + t_b)``
         for 1F1B; sec. 2.2.2, interleaved bubble ``(p - 1)/v`` chunk-times; sec. 3.5, full
         recomputation stores each layer's input and re-runs its forward (with its tensor-parallel
         all-reduces) before the backward.
  [SEL]  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
         MLSys'23, arXiv:2205.05198, sec. 5: selective recomputation re-runs only the attention
         core (the ``s x s`` scores, softmax, dropout and ``attn @ V``) and drops its activations.
  [ZERO] Rajbhandari et al., "ZeRO", SC'20, arXiv:1910.02054, sec. 5.1 and 7: stage 1 shards the
         optimizer state over dp; gradients are reduce-scattered and the updated parameters
         all-gathered, the same bytes as one all-reduce; stage 3 (sec. 5.3, 7.2.2) gathers
         each layer's parameters again for the backward: 1.5 times those bytes.
  [ADAM] Kingma & Ba, "Adam", ICLR'15, Alg. 1, in mixed precision (Micikevicius et al., ICLR'18):
         the update reads the 16-bit gradient, the fp32 master weight and both moments, and writes
         master, moments and the 16-bit weight: 2 + 3 * 4 + 3 * 4 + 2 = 28 bytes per parameter,
         a streaming kernel priced at the memory roofline.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar.cost_models.experts import ExpertsWork
from autopar.cost_models.topology import Topology

__all__ = ["UnitCosts", "LayerCosts", "Setup", "StepCost", "RECOMPUTE",
           "blocks_per_stage", "model_flops_megatron", "optimizer_step_time"]

RECOMPUTE = ("none", "selective", "full")
_ADAM_STEP_BYTES = 28  # [ADAM], per parameter, mixed precision
_SGD_STEP_BYTES = 12  # read grad and weight, write weight (fp32)


@dataclass(frozen=True)
class UnitCosts:
    """One layer unit, per microbatch on one rank: seconds and bytes.

    ``forward_comm_s`` / ``backward_comm_s`` are the collective parts of ``forward_s`` /
    ``backward_s``. ``param_elements``: parameter elements this rank holds for the unit.
    ``attention_forward_s`` / ``attention_bytes``: the attention core's share ([SEL]);
    ``random_bytes``: the values of random ops (dropout), which no recomputation re-runs (the
    runtime never replays a draw), so they stay saved under every policy.
    ``recompute_peak_bytes``: per policy, the bytes the unit's recomputed values occupy at once
    while its backward runs (held for one unit at a time, not per microbatch).
    """

    forward_s: float
    backward_s: float
    forward_comm_s: float
    backward_comm_s: float
    state_bytes: float
    activation_bytes: float
    param_elements: float
    attention_forward_s: float = 0.0
    attention_bytes: float = 0.0
    random_bytes: float = 0.0
    recompute_peak_bytes: tuple[tuple[str, float], ...] = ()
    # mixture-of-experts layers: the experts' share of ``param_elements`` and ``state_bytes``
    # (split over ep by ``step_price.price_setup``), and the all-to-alls each microbatch's
    # forward and backward would issue with the experts split (bytes a rank sends, any ep:
    # ``cost_models.experts``)
    expert_elements: float = 0.0
    expert_state_bytes: float = 0.0
    expert_forward_bytes: tuple[float, ...] = ()
    expert_backward_bytes: tuple[float, ...] = ()
    # the experts ops' work in the forward and the backward (its weights' traffic shrinks by ep)
    expert_forward_work: ExpertsWork = ExpertsWork(0.0, 0.0, 0.0)
    expert_backward_work: ExpertsWork = ExpertsWork(0.0, 0.0, 0.0)
    # the experts ops' forward seconds within ``forward_s`` (and their collectives' within
    # ``forward_comm_s``): full recomputation does not run them again (their backward op
    # takes their inputs, not their output)
    expert_forward_s: float = 0.0
    expert_forward_comm_s: float = 0.0
    # bytes per parameter element as ZeRO gathers them, on average over the unit's parameters
    # other than the experts' and over the experts' (under bf16 autocast a weight read only
    # through a cast to bf16 is gathered in bf16, the others in their own dtype:
    # ``autopar.capture.remat.gather_dtype``); None: the parameters' own
    gather_itemsize: float | None = None
    expert_gather_itemsize: float | None = None
    # of ``activation_bytes``, the parameters' copies the forward saves (autocast's bf16 casts
    # of the weights; ``autopar.capture.remat.regathered_nodes``), which a plan without a
    # pipeline does not save per microbatch under ZeRO (``step_price._regathered_saved``)
    regathered_bytes: float = 0.0
    # the most a backward op of the unit holds at once beyond the saved values (its outputs
    # and the gradients it reads: the loss's, the logits' gradient), a transient the
    # per-operator liveness counts (``step_price._step_buffers``)
    backward_transient_bytes: float = 0.0

    def peak(self, policy: str) -> float:
        """The recomputed values' bytes under ``policy`` (0 for ``"none"``)."""
        return dict(self.recompute_peak_bytes).get(policy, 0.0)

    def gathered_bytes(self, param_itemsize: int) -> tuple[float, float]:
        """Bytes ZeRO gathers of this unit's parameters: the others', the experts'."""
        width = lambda w: param_itemsize if w is None else w  # noqa: E731
        return ((self.param_elements - self.expert_elements) * width(self.gather_itemsize),
                self.expert_elements * width(self.expert_gather_itemsize))


@dataclass(frozen=True)
class LayerCosts:
    """The units of a model made of identical blocks, solved for one (tp, microbatch, sp).

    ``tied_state_bytes``/``tied_elements``: the parameters shared by ``pre`` and ``post`` (a tied
    embedding and LM head), counted in both. ``boundary_bytes``: the activation a pipeline stage
    sends per microbatch; ``input_bytes``: what a block keeps under full recomputation.
    """

    pre: UnitCosts
    block: UnitCosts
    post: UnitCosts
    num_blocks: int
    tied_state_bytes: float
    tied_elements: float
    boundary_bytes: float
    input_bytes: float
    param_itemsize: int
    optimizer: str
    expert_load_skew: float = 1.0  # (Config.expert_load_skew: of experts split over ranks)
    # the leading blocks that differ from the repeated ones (in ``pre``: DeepSeek-V3's dense
    # first layers), which recomputation treats as blocks: their number, their forward
    # seconds without their experts', and their saved bytes
    lead_blocks: int = 0
    lead_forward_s: float = 0.0
    lead_activation_bytes: float = 0.0


@dataclass(frozen=True)
class Setup:
    """The choices of one candidate beyond the per-layer intra-operator plan."""

    dp: int
    tp: int
    pp: int
    microbatch_size: int
    microbatches: int
    schedule: str  # "none" (pp = 1, gradient accumulation), "1f1b" or "interleaved-1f1b"
    virtual_stages: int
    recompute: str
    zero: int
    sequence_parallel: bool
    even_split: bool = False  # same blocks on every stage (Megatron-LM) instead of balanced times
    # when a pipeline's data-parallel gradient reduction runs: "step" (once, after the last
    # microbatch: Megatron-LM, with ZeRO-1 as its distributed optimizer, and autopar's pipeline
    # runtime without ZeRO), "gathered" (ZeRO-1 as autopar's runtime runs it: parameters stored
    # sharded over dp, gathered once a step, gradients reduce-scattered once a step) or
    # "microbatch" (in every microbatch's backward, the parameters gathered in every forward) or
    # "regathered" (ZeRO-3 as autopar's pipeline runs it: the parameters gathered for every
    # microbatch's forward and again for its backward, the gradients reduce-scattered once)
    grad_sync: str = "step"
    # the data-parallel ranks ZeRO shards over: 0 for all of dp, fewer for hybrid sharding
    # (shard groups of dp_shard consecutive ranks, replicated across the dp / dp_shard groups)
    dp_shard: int = 0
    # context parallelism: the sequence split over cp ranks (after dp in the mesh, before tp or,
    # with cp_inside_tp, after it); the per-layer costs are solved on the (cp, tp) submesh in
    # that order, the gradients reduced over dp and
    # then over cp once a step (partial sums over cp until then, as a pipeline stage runs them)
    cp: int = 1
    # expert parallelism: the experts of MoE layers split over ep of the dp ranks (consecutive,
    # inside dp: stride cp * tp), the tokens sent to them by all-to-all; their gradients
    # reduced over the dp / ep ranks holding the same experts
    ep: int = 1
    # the mesh order of cp and tp (both > 1): cp innermost, its ranks consecutive (stride 1),
    # tp outside it (stride cp), instead of tp innermost and cp at stride tp (Megatron-LM's)
    cp_inside_tp: bool = False
    # the ep ranks are the cp ranks (ep == cp), not cut from dp: the experts split over the cp
    # axis (stride tp, or 1 with cp_inside_tp), their gradients reduced over dp only
    ep_in_cp: bool = False

    @property
    def cp_innermost(self) -> bool:
        """``cp_inside_tp`` where it is an order (cp and tp both > 1), else ``False``."""
        return self.cp_inside_tp and self.cp > 1 and self.tp > 1

    @property
    def shard(self) -> int:
        """The ranks a parameter is sharded over under ZeRO (dp, or the hybrid group)."""
        return self.dp_shard or self.dp

    def describe(self) -> str:
        """One line such as ``dp=32 tp=8 pp=4 b=1 m=56 interleaved-1f1b v=2 full zero1 sp``."""
        sched = "" if self.pp == 1 else f" {self.schedule}" + (
            f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{f' cp={self.cp}' if self.cp > 1 else ''}"
                f"{f' ep={self.ep}' if self.ep > 1 else ''}{' (cp)' if self.ep_in_cp else ''} "
                f"b={self.microbatch_size} "
                f"m={self.microbatches}{sched} recompute={self.recompute} zero={self.zero}"
                f"{f' dp_shard={self.dp_shard}' if self.dp_shard else ''}"
                f"{' sp' if self.sequence_parallel else ''}"
                f"{' cp-inside-tp' if self.cp_innermost else ''}")


@dataclass(frozen=True)
class StepCost:
    """Predicted step of one setup: time, its parts, and memory per pipeline rank
    (``stage_time_s``: forward + backward of one microbatch per stage, ``stage_forward_s`` its
    forward part)."""

    setup: Setup
    step_time_s: float
    parts: dict[str, float]
    blocks_per_stage: tuple[int, ...]
    stage_time_s: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]
    budget_bytes: float
    stage_memory_bytes: tuple[float, ...] = ()
    stage_forward_s: tuple[float, ...] = ()

    @property
    def fits(self) -> bool:
        """Whether every rank's memory is within the budget."""
        return max(self.rank_memory_bytes) <= self.budget_bytes

    def reason(self) -> str:
        """Why the setup does not fit (empty when it fits)."""
        if self.fits:
            return ""
        r = max(range(len(self.rank_memory_bytes)), key=self.rank_memory_bytes.__getitem__)
        return (f"pipeline rank {r} needs {self.rank_memory_bytes[r] / 2**30:.1f} GiB per device, "
                f"over the {self.budget_bytes / 2**30:.1f} GiB budget")


@functools.lru_cache(maxsize=4096)  # (the same split for every setup of one layer pricing)
def blocks_per_stage(num_blocks: int, stages: int, pre_s: float, post_s: float,
                     block_s: float) -> tuple[int, ...]:
    """Blocks of each stage, balancing stage times when the first stage also runs ``pre`` and the
    last ``post``: the fewest-blocks-first filling of a water level."""
    if stages == 1:
        return (num_blocks,)
    extra = [0.0] * stages
    extra[0] += pre_s
    extra[-1] += post_s
    counts = [0] * stages
    for _ in range(num_blocks):  # give the next block to the stage that finishes first
        j = min(range(stages), key=lambda k: (extra[k] + counts[k] * block_s, k))
        counts[j] += 1
    return tuple(counts)


def optimizer_step_time(elements: float, optimizer: str, topology: Topology) -> float:
    """Seconds of the optimizer's update of ``elements`` parameters on one device: a
    memory-bound pass over the bytes it reads and writes per parameter (Adam in mixed precision
    28 B: [ADAM]; SGD 12 B) at the topology's pointwise share of memory bandwidth."""
    step_bytes = _ADAM_STEP_BYTES if optimizer == "adam" else _SGD_STEP_BYTES
    return elements * step_bytes / (topology.mem_bandwidth_Bps * topology.pointwise_efficiency)


def model_flops_megatron(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """[MEG] Eq. 3: FLOPs of one iteration with full recomputation, the numerator of Table 1's
    TFLOP/s: ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden)
                                                   + vocab / (16 * layers * hidden))


"""``autopar.Config``: the user's knobs for planning."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from autopar.cost_models.pipeline import SCHEDULES

__all__ = ["CP_ATTENTION", "CP_LAYOUTS", "Config", "ZERO_STAGES"]

_UNKNOWN_OP = ("replicate", "error")
_RECOMPUTE = ("none", "selective", "full")
# context parallelism's two forms of attention (autopar.strategies.rules): keys and values
# all-gathered over cp, or passed around its ranks (ring attention)
CP_ATTENTION = ("gather", "ring")
CP_LAYOUTS = ("balanced", "contiguous")
# ZeRO stages (Rajbhandari et al., SC'20, sec. 5): 1 and 2 run one program (see Config.zero)
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Config:
    """What the user fixes; every ``None`` is left to the search.

    Attributes:
        dp: data-parallel degree, or ``None`` to search.
        tp: tensor-parallel degree, or ``None`` to search.
        pp: pipeline-parallel degree, or ``None`` to search.
        cp: context-parallel degree: the sequence dim of the inputs (dim 1) and of the
            activations split over ``cp`` ranks, attention run over them in the form of
            ``cp_attention``, parameters replicated on them and their gradients all-reduced.
            ``None``: the setup search tries it for sequences of 65,536 tokens or more, 1
            otherwise (``autopar.planning.setups.CP_MIN_SEQUENCE``).
        cp_attention: how attention runs over cp: ``"gather"`` (the keys and values
            all-gathered over the cp ranks before the rank's queries attend to them, their
            gradients reduce-scattered after: Llama 3's form), ``"ring"`` (the keys and values
            passed from rank to rank in blocks while each block's attention computes, merged by
            their log-sum-exps: ring attention, ``autopar.passes.ring_attention``), or ``None``:
            the planner prices both per attention and takes the cheaper.
        cp_layout: which positions each cp rank holds: ``"balanced"`` (the sequence cut into
            2 x cp chunks, rank r holding chunks r and 2cp-1-r, so that causal attention's work
            is the same on every rank: Megatron-LM's and torchtitan's split;
            ``autopar.sequence_layout``), ``"contiguous"`` (rank r holding the r-th of cp
            blocks), or ``None``: balanced where the sequence divides by 2 x cp.
        cp_inside_tp: the order of the cp and tp axes in the mesh when both are larger than 1:
            ``False`` puts tp innermost (its ranks consecutive, on a node's fastest links, cp
            outside it: Megatron-LM's order), ``True`` cp innermost (tp outside it), ``None``
            lets the planner price both where they differ (cp x tp spanning nodes) and take the
            faster, tp innermost otherwise.
        ep: expert-parallel degree of mixture-of-experts layers: each layer's experts split
            over ``ep`` of the data-parallel ranks (ep divides dp, as Megatron-LM and
            torchtitan fold it), the (token, choice) pairs sent to their experts' ranks and
            back by all-to-all; every other part of the model sees them as data-parallel
            ranks. ``None``: the planner tries the divisors of dp for models with experts
            (``autopar.capture.moe``), 1 for others. With context parallelism the ep ranks may
            be the cp ranks instead (``ep_in_cp``).
        ep_in_cp: where the expert-parallel ranks come from when cp > 1: ``True``: they are
            the cp ranks (ep = cp; the experts split over the cp axis, each rank's sequence
            chunk sending its pairs to the experts' ranks there: Megatron-LM's MoE parallel
            folding and torchtitan take ep from cp so), ``False``: cut from dp (ep divides dp),
            ``None``: the planner prices both where both fit and takes the faster.
        expert_load_skew: the routing skew the cost model assumes for MoE experts split over
            ranks: the busiest rank's rows over the mean (1.0: uniform routing; a trained
            router is rarely that even: ``benchmarks/moe_ep.py`` measures it). It scales the
            split experts' compute and their all-to-alls' time, not the plan's listed bytes.
        memory_bytes: per-device memory budget; ``None`` takes the topology preset's memory.
        solver_time_limit_s: time limit of each ILP solve.
        unknown_op: what to do with an operator that has no sharding rule: ``"replicate"``
            (correct, maybe slow; recorded as a warning in the plan) or ``"error"``.
        optimizer: optimizer whose state is counted in memory (``"adam"`` or ``"sgd"``).
        schedule: pipeline schedule, one of ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``,
            ``"zero-bubble"`` (torch's ``ScheduleInterleavedZeroBubble``), or ``None`` to search.
        virtual_stages: model chunks per pipeline rank (``v``; only the interleaved and
            zero-bubble schedules take more than 1), or ``None`` to search.
        microbatch_size: samples per microbatch over all data-parallel replicas (the global
            batch, the example inputs' dim 0, is split into batch / microbatch_size of them;
            each replica runs microbatch_size / dp samples of each), or ``None`` to search.
        recompute: activation recomputation, ``"none"``, ``"selective"`` (attention core) or
            ``"full"`` (each block's forward re-run in the backward), or ``None``: turned on
            only when the plan does not fit memory without it.
        zero: ZeRO stage (Rajbhandari et al., SC'20, sec. 5): 0; 2 (parameters stored sharded
            over dp between steps, so the optimizer's states are too; gradients
            reduce-scattered into the owner's shard; parameters all-gathered where the forward
            first uses them and held through the backward, as FSDP2's
            ``reshard_after_forward=False``: ZeRO-2's memory and more, for an all-reduce's
            communication); 1 (the same program as 2: stage 1 alone, gradients all-reduced whole
            on every rank, moves the same bytes and holds more, so autopar never runs it; the
            plan records the stage asked for); 3 (as 2, and each parameter's gathered copy
            freed after its last forward use and gathered again for the backward, as FSDP's
            ``reshard_after_forward=True``; in a pipeline, each stage's parameters gathered for
            every microbatch's forward and again for its backward, freed in between, their
            gradients summed over the microbatches and reduce-scattered once a step); or
            ``None``: turned on (1, then 3) only when the plan does not fit memory without it.
        dp_shard: the data-parallel ranks ZeRO shards a parameter (its gradient and optimizer
            states) over: all of them (``None`` or ``dp``), or fewer (hybrid sharding, HSDP as
            FSDP2 runs it: shard groups of ``dp_shard`` consecutive ranks, inside a node first,
            each parameter replicated across the ``dp / dp_shard`` groups; its gradients
            reduce-scattered within a group and all-reduced across groups; in a pipeline, each
            stage's). Needs ``zero`` 1 to 3; ``None`` lets the setup search choose it.
        sequence_parallel: shard the layer norms and the residual adds on the sequence dim over
            the tp axis (Megatron-LM's sequence parallelism: reduce-scatter + all-gather instead
            of all-reduce), or ``None`` to let the solver choose.
        mixed_precision: ``"bf16"`` runs the model under ``torch.autocast`` (bf16 matmuls, fp32
            master weights, gradients reduced in fp32), ``"fp32"`` or ``None`` as the model is
            (never changed behind the user's back: precision changes the numbers).
        bucket_bytes: gradient all-reduces are merged into buckets of up to this many bytes
            (the first bucket up to 1 MiB), each issued as soon as its last gradient exists and
            waited for at the end of the backward, as ``DistributedDataParallel`` does (25 MiB
            by default there); ``0`` reduces every gradient alone (still overlapped); ``None``
            lets the planner choose the cap (1, 4 or 25 MiB) with the shortest predicted step.
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    cp_attention: str | None = None
    cp_layout: str | None = None
    cp_inside_tp: bool | None = None
    ep: int | None = None
    ep_in_cp: bool | None = None
    expert_load_skew: float = 1.0
    memory_bytes: float | None = None
    solver_time_limit_s: float = 30.0
    unknown_op: str = "replicate"
    optimizer: str = "adam"
    schedule: str | None = None
    virtual_stages: int | None = None
    microbatch_size: int | None = None
    recompute: str | None = None
    zero: int | None = None
    dp_shard: int | None = None
    sequence_parallel: bool | None = None
    mixed_precision: str | None = None
    bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "microbatch_size", "dp_shard"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(
                    f"Config.{name}={value!r}: must be a positive int, or None to let the search "
                    f"choose it."
                )
        self._check_choices()
        self._check_dp_shard()
        self._check_experts()
        if self.sequence_parallel not in (None, True, False):
            raise ValueError(f"Config.sequence_parallel={self.sequence_parallel!r}: use True, "
                             f"False or None.")
        if self.mixed_precision not in (None, "fp32", "bf16"):
            raise ValueError(f"Config.mixed_precision={self.mixed_precision!r}: use 'fp32', "
                             f"'bf16' or None (the model's own precision).")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"Config.optimizer={self.optimizer!r}: use 'adam' or 'sgd'.")
        if self.memory_bytes is not None and not 0 < self.memory_bytes < math.inf:  # and NaN
            raise ValueError(
                f"Config.memory_bytes={self.memory_bytes!r}: give a positive, finite per-device "
                f"budget in bytes, or None for the topology's memory."
            )
        if self.bucket_bytes is not None and (
                not isinstance(self.bucket_bytes, int) or isinstance(self.bucket_bytes, bool)
                or self.bucket_bytes < 0):
            raise ValueError(f"Config.bucket_bytes={self.bucket_bytes!r}: give a cap in bytes "
                             f"(an int >= 0; 0 reduces every gradient alone), or None to let "
                             f"the planner choose.")
        if not self.solver_time_limit_s > 0:  # also refuses NaN
            raise ValueError(
                f"Config.solver_time_limit_s={self.solver_time_limit_s!r} must be positive."
            )

    def _check_choices(self) -> None:
        """The fields that take one of a few values."""
        if self.unknown_op not in _UNKNOWN_OP:
            raise ValueError(
                f"Config.unknown_op={self.unknown_op!r}: use one of {_UNKNOWN_OP}."
            )
        if self.cp_attention is not None and self.cp_attention not in CP_ATTENTION:
            raise ValueError(f"Config.cp_attention={self.cp_attention!r}: use one of "
                             f"{CP_ATTENTION}, or None to let the planner choose.")
        if self.cp_layout is not None and self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"Config.cp_layout={self.cp_layout!r}: use one of {CP_LAYOUTS}, or "
                             f"None for the balanced one where the sequence divides.")
        if not (self.cp_inside_tp is None or isinstance(self.cp_inside_tp, bool)):
            raise ValueError(f"Config.cp_inside_tp={self.cp_inside_tp!r}: use True (cp the "
                             f"innermost axis), False (tp innermost) or None to let the planner "
                             f"choose.")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"Config.schedule={self.schedule!r}: use one of {SCHEDULES}, or None "
                             f"to let the search choose.")
        if self.recompute is not None and self.recompute not in _RECOMPUTE:
            raise ValueError(f"Config.recompute={self.recompute!r}: use one of {_RECOMPUTE}, or "
                             f"None to let the search choose.")
        if self.zero is not None and (self.zero not in ZERO_STAGES or isinstance(self.zero, bool)):
            raise ValueError(f"Config.zero={self.zero!r}: use a ZeRO stage of {ZERO_STAGES}, or "
                             f"None to let the planner choose.")

    def _check_experts(self) -> None:
        """The expert-parallel fields, and their fit with dp and hybrid sharding."""
        if isinstance(self.expert_load_skew, bool) or not (
                isinstance(self.expert_load_skew, (int, float)) and 1.0 <= self.expert_load_skew < math.inf):
            raise ValueError(f"Config.expert_load_skew={self.expert_load_skew!r}: give the busiest "
                             f"rank's routed rows over the mean, a finite number >= 1.0 (1.0: "
                             f"uniform routing).")
        if not (self.ep_in_cp is None or isinstance(self.ep_in_cp, bool)):
            raise ValueError(f"Config.ep_in_cp={self.ep_in_cp!r}: use True (the ep ranks are the "
                             f"cp ranks), False (cut from dp) or None to let the planner choose.")
        if self.ep_in_cp and (self.cp == 1 or self.ep == 1 or (
                self.ep is not None and self.cp is not None and self.ep != self.cp)):
            raise ValueError(f"Config(cp={self.cp}, ep={self.ep}, ep_in_cp=True): the ep ranks "
                             f"taken from cp are all of cp's, so ep = cp > 1; set cp > 1 and ep "
                             f"to cp (or None), or leave ep_in_cp None.")
        if self.ep is not None and self.ep > 1 and self.dp is not None and self.dp % self.ep \
                and not (self.ep_in_cp is not False and self.ep == self.cp):
            raise ValueError(f"Config(dp={self.dp}, ep={self.ep}): the expert-parallel ranks are "
                             f"data-parallel ranks, so ep must divide dp; use a divisor of "
                             f"{self.dp} (or ep = cp with ep_in_cp, the ep ranks taken from cp).")
        if self.ep is not None and self.ep > 1 and self.dp_shard is not None:
            raise ValueError(f"Config(ep={self.ep}, dp_shard={self.dp_shard}): autopar does not "
                             f"combine hybrid sharding with expert parallelism yet (from dp or "
                             f"from cp); leave one of them None.")

    def _check_dp_shard(self) -> None:
        if self.dp_shard is None:
            return
        if self.dp_shard == 1:
            raise ValueError("Config(dp_shard=1) shards nothing: use zero=0 (every rank holds "
                             "everything), or a shard group of 2 or more ranks.")
        if self.zero == 0:
            raise ValueError(f"Config(dp_shard={self.dp_shard}, zero=0): dp_shard is the group "
                             f"ZeRO shards over; set zero to 1, 2 or 3 (or None), or leave "
                             f"dp_shard None.")
        if self.dp is not None and self.dp % self.dp_shard:
            raise ValueError(f"Config(dp={self.dp}, dp_shard={self.dp_shard}): the shard group "
                             f"must divide dp; use a divisor of {self.dp}.")

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Config fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

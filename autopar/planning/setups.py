"""The setups the whole-plan search prices (DESIGN §6, outer search): every factorisation of
the devices into (dp, tp, pp, cp, ep) the ``Config`` allows, with tp inside a node, and every
microbatch size, schedule, recomputation, ZeRO stage and sequence parallelism that goes with it
(:func:`candidate_setups`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import torch

from autopar.config import Config
from autopar.cost_models.training_step import RECOMPUTE, Setup, StepCost
from autopar.planning.candidates import cp_orders, ep_options

__all__ = ["CP_MAX", "CP_MIN_SEQUENCE", "TP_ACROSS_NODES_MAX", "candidate_setups", "cp_degrees",
           "only_when_needed", "sequence_length", "sequences_beside_cp",
           "tp_degrees", "tried_last", "Twins", "zero_stages"]

_MAX_MICROBATCH = 8
_MAX_VIRTUAL = 8


def sequences_beside_cp(setup: Setup) -> bool:
    """Whether ``setup`` has dp > 1 and cp > 1 with more than one sequence a replica's
    microbatch: its linear layers run on the whole sequence on each cp rank (the flattened
    batch and sequence split on both axes needs one sequence a dp block,
    ``strategies.nested_views``), which the search's layer prices do not show."""
    return setup.cp > 1 and setup.dp > 1 and setup.microbatch_size > 1


def tried_last(setup: Setup, config: Config) -> bool:
    """Whether the search prices ``setup`` only if no other setup fits: one of
    :func:`sequences_beside_cp`, unless the ``Config`` fixes dp and cp both or sets
    ``microbatch_size``."""
    return (sequences_beside_cp(setup) and config.microbatch_size is None
            and None in (config.dp, config.cp))


def only_when_needed(ranked: list[StepCost]) -> list[StepCost]:
    """Drop a setup that recomputes or shards the optimizer when a twin doing less of either
    (same degrees, microbatches and schedule) fits too: the techniques are for memory, and
    turned on only when memory requires them (as ``make_plan`` does). A twin that fits is always
    in ``ranked``, so the best setup is never lost, only a faster-on-paper one that trades
    memory the job does not need (ZeRO-1's optimizer step is priced 1/dp: that alone is not a
    reason to shard)."""
    fits = Twins()
    for c in ranked:
        fits.add(c.setup)
    return [c for c in ranked if not fits.has_lighter(c.setup)]


class Twins:
    """A set of setups kept by twin: the same setup but for recomputation and ZeRO (and the
    stage split and gradient-sync mode, which follow), as :func:`only_when_needed` compares
    them."""

    def __init__(self) -> None:
        self._by_base: dict[Setup, list[tuple[int, int, int]]] = {}

    @staticmethod
    def _base(setup: Setup) -> Setup:
        """What ``setup``'s twins share: itself without recomputation, ZeRO and what follows
        from them (the ZeRO shard group is kept beside it, per twin)."""
        return dataclasses.replace(setup, even_split=False, grad_sync="step", dp_shard=0,
                                   recompute="none", zero=0)

    def add(self, setup: Setup) -> None:
        """Put ``setup`` in the set."""
        self._by_base.setdefault(self._base(setup), []).append(
            (RECOMPUTE.index(setup.recompute), setup.zero, setup.dp_shard if setup.zero else 0))

    def has_lighter(self, setup: Setup) -> bool:
        """Whether a twin of ``setup`` with less recomputation or ZeRO (or both) is in the set
        (a twin with ZeRO sharding over the same ``dp_shard``)."""
        known = self._by_base.get(self._base(setup)) if self._by_base else None
        if not known:
            return False
        r, z = RECOMPUTE.index(setup.recompute), setup.zero
        return any(r2 <= r and z2 <= z and (r2, z2) != (r, z) and (z2 == 0 or s2 == setup.dp_shard)
                   for r2, z2, s2 in known)


def candidate_setups(num_devices: int, gpus_per_node: int, batch: int, num_blocks: int,
                     config: Config, tp_max: int | None = None,
                     replica_microbatches: Sequence[int] | None = None,
                     seq: int | None = None, experts: int = 0) -> Iterator[Setup]:
    """Every setup allowed by ``config``: (dp, tp, pp, cp) with tp dividing a node, cp of
    :func:`cp_degrees` for a sequence of ``seq`` tokens in the mesh orders of
    :func:`~autopar.planning.candidates.cp_orders`, ep of :func:`~autopar.planning.candidates.ep_options` for MoE
    layers of ``experts`` experts, microbatch size
    ``b`` a power of two up to 8 dividing the per-replica batch (Megatron-LM's range, SC'21
    Fig. 7) with a pipeline, the whole per-replica batch without one (the runtime does not
    accumulate gradients over microbatches without a pipeline), schedules, recomputation,
    ZeRO stages (:func:`zero_stages`) and sequence parallelism (only with tp > 1)."""
    tps = [t for t in tp_degrees(num_devices, gpus_per_node) if t <= (tp_max or t)]
    for tp, cp, inside in ((t, c, i) for t in tps for c in cp_degrees(config, seq, num_devices // t)
                           for i in cp_orders(config, c, t, gpus_per_node)):
        for pp in _divisors(num_devices // (tp * cp)):
            dp = num_devices // (tp * cp * pp)
            if pp > num_blocks or batch % dp or not _allowed(config, dp=dp, tp=tp, pp=pp):
                continue
            for b in _divisors(batch // dp):
                if pp == 1 and b != batch // dp:  # without a pipeline the step runs the whole batch
                    continue
                if config.microbatch_size is None and pp > 1 and (b > _MAX_MICROBATCH or b & (b - 1)):
                    continue
                if cp > 1 and pp > 1 and b > 1 and config.microbatch_size is None:
                    continue  # a long sequence's microbatch is one sample (Llama 3 at 128K)
                # Config.microbatch_size counts the samples of a microbatch over all replicas
                if config.microbatch_size not in (None, b * dp):
                    continue
                if replica_microbatches is not None and b not in replica_microbatches:
                    continue
                m = batch // (dp * b)
                for schedule, v in _schedule_options(pp, m, num_blocks, config):
                    for rc in RECOMPUTE:
                        for zero, shard in _sharding(config, dp, pp):
                            # (with cp too: the norms' sequence split over cp and tp both,
                            # as Llama 3 405B ran at 128K tokens)
                            for sp in (False, True) if tp > 1 else (False,):
                                if not _allowed(config, recompute=rc, sequence_parallel=sp):
                                    continue
                                # the runtime reduces a pipeline's gradients once a step
                                # (runtime.pipeline, every schedule), with ZeRO-1 as
                                # reduce-scatter and a gather of the parameters
                                for ep, in_cp in ep_options(config, dp, cp, experts, bool(shard)):
                                    yield Setup(dp, tp, pp, b, m, schedule, v, rc, zero, sp,
                                                grad_sync=_grad_sync(zero, pp), dp_shard=shard,
                                                cp=cp, ep=ep, cp_inside_tp=inside,
                                                ep_in_cp=in_cp)


# the shortest sequence for which the search tries context parallelism when Config.cp is None.
# CP pays at shorter sequences too (NVIDIA's Llama 3.1 recipes use cp=2 at 8K tokens), but each
# (cp, tp) layer ILP costs 5-25 s (Llama-7B at 32K tokens on 16 H100s: 261 s of search with cp
# against 13 s without), so for now only sequences that hardly fit without it are searched
# with it; a cp set in the Config is priced at any length
CP_MIN_SEQUENCE = 65536
CP_MAX = 32


def cp_degrees(config: Config, seq: int | None, devices: int) -> list[int]:
    """The context-parallel degrees searched within ``devices``: ``Config.cp`` when set; else 1
    and, for a sequence of at least :data:`CP_MIN_SEQUENCE` tokens, each power of two up to
    :data:`CP_MAX` that divides the devices and the sequence in two chunks per rank."""
    if config.cp is not None:
        return [config.cp] if devices % config.cp == 0 else []
    if seq is None or seq < CP_MIN_SEQUENCE:
        return [1]
    return [1] + [c for c in (2, 4, 8, 16, 32) if c <= CP_MAX and devices % c == 0
                  and seq % (2 * c) == 0]


def sequence_length(example_inputs: Any) -> int | None:
    """The sequence length of a batch: dim 1 of its first input of two or more dims."""
    from autopar._torch_private import tree_flatten

    shapes = [tuple(x.shape) for x in tree_flatten(example_inputs)[0]
              if isinstance(x, torch.Tensor) and x.dim() >= 2]
    return shapes[0][1] if shapes else None


def zero_stages(config: Config, dp: int, pp: int) -> tuple[int, ...]:
    """The ZeRO stages searched for a setup of ``dp`` replicas (and ``pp`` pipeline stages,
    which all run under every stage): the one ``Config.zero`` forces, or 0, 1 and 3; stage 2
    runs ZeRO-1's program (``Config.zero``), so it is searched only when forced. Nothing is
    sharded without dp."""
    if dp == 1:
        return (0,) if config.zero in (None, 0) else ()
    if config.zero is not None:
        return (config.zero,)
    return (0, 1, 3)


def _grad_sync(zero: int, pp: int) -> str:
    """How the runtime synchronises a setup's data-parallel gradients (``Setup.grad_sync``)."""
    if not zero:
        return "step"
    return "regathered" if zero == 3 and pp > 1 else "gathered"


def _sharding(config: Config, dp: int, pp: int) -> Iterator[tuple[int, int]]:
    """(ZeRO stage, shard group) pairs of a setup: each of :func:`zero_stages`, sharded over
    all of dp (0) or over groups of each divisor of dp in between (hybrid sharding), or as
    ``Config.dp_shard`` says."""
    for zero in zero_stages(config, dp, pp):
        if zero == 0:
            if config.dp_shard in (None, dp):
                yield zero, 0
            continue
        groups = [config.dp_shard] if config.dp_shard is not None else \
            [g for g in _divisors(dp) if 1 < g < dp] + [dp]
        for g in groups:
            if dp % g == 0:
                yield zero, 0 if g == dp else g


# the largest tensor-parallel group the search forms across nodes: Megatron-LM's largest tp
# ([MEG] sec. 3.2, tp = 8 in a DGX node); on nodes of 8 or more devices tp stays inside a node
TP_ACROSS_NODES_MAX = 8


def tp_degrees(num_devices: int, gpus_per_node: int) -> list[int]:
    """The tensor-parallel degrees searched: divisors of the devices that divide a node, or (on
    nodes of fewer than :data:`TP_ACROSS_NODES_MAX` devices) span whole nodes up to it."""
    return [t for t in _divisors(num_devices)
            if gpus_per_node % t == 0 or (t % gpus_per_node == 0 and t <= TP_ACROSS_NODES_MAX)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(config: Config, **values: Any) -> bool:
    return all(getattr(config, k, None) in (None, v) for k, v in values.items())


def _schedule_options(pp: int, m: int, num_blocks: int, config: Config) -> list[tuple[str, int]]:
    """(schedule, v): gradient accumulation without a pipeline; with one, 1F1B and interleaved
    1F1B with v > 1 chunks when m is a multiple of pp ([MEG] sec. 2.2.2) and there are at least
    as many blocks as the pp * v stages. Megatron-LM also asks the blocks to split evenly
    into the stages; Llama 3 405B's 126 layers ran interleaved on 16 stages with one layer
    fewer on the first and the last (Dubey et al., 2024, sec. 3.3.2), and autopar's pipeline
    runs stages of any block counts (the search prices the balanced split and the even one,
    which differs by a block at most). A v whose largest stage holds as many blocks as a
    smaller v's is left out, unless the ``Config`` asks for it: its bubble, (pp - 1) such
    stages, is no shorter, and it sends more and holds more microbatches in flight."""
    if pp == 1:
        return [("none", 1)]
    out = [("1f1b", 1)] if m >= pp else []
    largest = set()  # (the blocks of a v's largest stage)
    for v in range(2, _MAX_VIRTUAL + 1):
        chunk = -(-num_blocks // (pp * v))
        if pp * v <= num_blocks and m % pp == 0 and (chunk not in largest
                                                     or config.virtual_stages == v):
            largest.add(chunk)
            out.append(("interleaved-1f1b", v))
    return [(s, v) for s, v in out if (config.schedule in (None, s))
            and config.virtual_stages in (None, v)]

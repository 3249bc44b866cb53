"""The whole-plan search at cluster scale (DESIGN §6, outer search).

Candidates: the setups of :func:`autopar.planning.setups.candidate_setups` (every factorisation
of the devices into (dp, tp, pp, cp, ep) with tp inside a node, every microbatch size, schedule,
recomputation, ZeRO stage and sequence parallelism the ``Config`` allows).

The model is not traced whole. Its repeated blocks are checked to be identical, and a copy with
only two of them (``pre``, ``blocks.0``, ``blocks.1``, ``post``) is traced per microbatch size
with autopar's own capture; its intra-operator ILP is solved once per distinct
(tensor-parallel degree, microbatch size, sequence parallelism) on the ``tp`` submesh and cached
(the same ILP, strategies and cost model the runtime's plans use). The per-layer costs of that
solution price every candidate in closed form (:mod:`autopar.cost_models.step_price`);
candidates that do not fit the device memory are pruned with the reason kept. The data-parallel
degree only splits the batch and adds the gradient reduction, priced per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.nn as nn

from autopar.capture import model_fingerprint
from autopar.config import Config
from autopar.cost_models.compute import graph_flops
from autopar.cost_models.step_price import memory_floor, price_setup
from autopar.cost_models.training_step import (
    LayerCosts, Setup, StepCost, UnitCosts,
)
from autopar.errors import PlanError
from autopar.mesh import Mesh
from autopar.capture.moe import expert_count
from autopar.capture.layers import (
    block_fingerprint, block_prefix, identical_blocks, is_op, leading_blocks, with_blocks,
)
from autopar.planning.ahead import (
    AheadSolver, LayerKey, TraceFacts, default_workers, fork_is_safe,
)
from autopar.planning.pipeline import batch_size
from autopar.planning.records import NORMS
from autopar.planning.candidates import Candidate, inner_axes
from autopar.planning.setups import (
    TP_ACROSS_NODES_MAX, Twins, candidate_setups, only_when_needed, sequence_length, tp_degrees,
    tried_last,
)
from autopar.planning.solve import solve_space, unpinned_space
from autopar.planning.unit_costs import layer_costs
from autopar.cost_models.experts import ExpertsWork
from autopar.capture.stages import capture_with_forward, first_microbatch

__all__ = ["AHEAD_AFTER_S", "AHEAD_MIN_PARAMS", "LayerSolver", "SearchResult", "layer_key", "model_flops",
           "only_when_needed", "pipelines_always", "pruned_examples", "search",
           "search_unsupported", "start_ahead", "two_block_copy"]

# Two-block traces of the last models searched in this process, by model fingerprint (structure,
# shapes and dtypes: a trace is priced, never run, so another instance of the same model reuses
# it, as a job planning several configurations of one model does) and whether under autocast
_TRACES: dict[tuple[str, bool], tuple[Any, Any]] = {}
_TRACE_CACHE_SIZE = 8
# A search forks workers (LayerSolver.workers) for a model of this many parameters or more
# whose first trace takes this long: forking a process and sending results back costs tens of
# milliseconds, and a small model's first trace can take seconds of torch.export's own start-up
AHEAD_MIN_PARAMS = 10**9
AHEAD_AFTER_S = 1.0


@dataclass(frozen=True)
class SearchResult:
    """The search's answer: feasible setups best first, and the pruned ones with their reason.

    ``ranked[0]`` is the best. ``timings``: seconds spent tracing, solving the per-layer ILPs and
    pricing candidates (the traces and ILPs of workers solving ahead counted too: with
    ``timings["workers"]`` > 0 they may add up to more than ``total_s``); ``layer_solves``:
    distinct per-layer ILPs solved.
    """

    ranked: tuple[StepCost, ...]
    pruned: tuple[StepCost, ...]
    evaluated: int
    layer_solves: int
    timings: dict[str, float]
    num_devices: int
    bounded: int = 0  # setups with cp or tp > 1 skipped: their lower bound no better than the best
    # setups not priced (not in ``pruned``): their training state alone is over the budget
    # (step_price.memory_floor); when nothing fits, the search prices them too (for the
    # smallest need its InfeasibleMemoryError names) and returns no result
    set_aside: tuple[Setup, ...] = ()
    # setups not priced (nor counted in ``evaluated``): a twin with less recomputation or ZeRO
    # fits, so only_when_needed would drop them
    twins: int = 0

    @property
    def over_memory(self) -> int:
        """How many setups were set aside by their memory floor, unpriced."""
        return len(self.set_aside)

    @property
    def best(self) -> StepCost:
        """The setup with the lowest predicted step time."""
        return self.ranked[0]


def layer_key(setup: Setup) -> tuple[int, int, bool, int, bool]:
    """The arguments of :meth:`LayerSolver.costs` for ``setup`` (its key there): tp, microbatch
    size, sequence parallelism, cp, and the cp-inside-tp order where it is one (cp, tp > 1)."""
    return setup.tp, setup.microbatch_size, setup.sequence_parallel, setup.cp, setup.cp_innermost


class LayerSolver:
    """A model's copy with two blocks, traced per microbatch size and solved per
    :func:`layer_key` (tp, b, sp, cp and the order of cp and tp);
    pass one to several :func:`search` calls on the same model and mesh to share the work.

    ``workers``: processes that a search forks to solve layer costs ahead of it
    (:mod:`autopar.planning.ahead`; ``None``: one fewer than the CPUs, 0: none), started when
    the model has :data:`AHEAD_MIN_PARAMS` parameters or more and a trace takes
    :data:`AHEAD_AFTER_S` seconds or more."""

    def __init__(self, model: nn.Module, example_inputs: Any, mesh: Mesh, config: Config,
                 cost_passes: Sequence[Callable[..., Any]], workers: int | None = None) -> None:
        # the layer ILP prices one microbatch's block as it runs; recomputation and ZeRO are
        # priced in closed form on top of it (cost_models/step_price.py), not twice
        self.config = dataclasses.replace(config, recompute="none", zero=0, dp_shard=None)
        self.mesh, self.cost_passes = mesh, cost_passes
        self.example_inputs = example_inputs
        self.batch = batch_size(example_inputs)
        # (num_blocks: the repeated blocks after the ``lead`` leading ones that differ, traced
        # one per run of identical ones: ``lead_runs``)
        self.params = sum(p.numel() for p in model.parameters())  # (the whole model's)
        self.model, self.prefix, self.num_blocks, self.lead_runs = two_block_copy(model)
        self.lead = sum(self.lead_runs)
        block = repr([block_fingerprint(b) for b in
                      list(model.get_submodule(self.prefix))[:self.lead + 1]]).encode()
        self.fingerprint = (f"{type(model).__name__}:{self.lead}+{self.num_blocks}x"
                            f"{hashlib.sha256(block).hexdigest()[:12]}")
        self.traces: dict[int, tuple[Any, Any]] = {}
        self.solved: dict[tuple[int, int, bool, int, bool], LayerCosts] = {}  # layer_key
        self.spaces: dict[tuple[int, int, int, bool], Any] = {}
        self._facts: dict[int, TraceFacts] = {}  # per microbatch size
        self.workers = default_workers() if workers is None else workers
        self.ahead: AheadSolver | None = None  # (while a search runs: start_ahead)
        self._priced: dict = {}  # (prices shared by the spaces: cost_models.sharding.price_space)
        self.seq = sequence_length(example_inputs)
        self.num_experts = expert_count(model)  # (of its MoE layers; 0 without)
        self.trace_s = self.solve_s = 0.0

    def costs(self, tp: int, b: int, sp: bool, cp: int = 1,
              cp_inside_tp: bool = False) -> LayerCosts:
        """Per-layer costs at tensor-parallel degree ``tp``, ``b`` samples per microbatch and
        context-parallel degree ``cp`` (solved on the (cp, tp) submesh, or (tp, cp) with
        ``cp_inside_tp``, attention's queries split on the sequence over cp)."""
        inside = cp_inside_tp and cp > 1 and tp > 1
        key = (tp, b, sp, cp, inside)
        if key not in self.solved and self.ahead is not None:
            done = self.ahead.take(key)
            if done is not None:
                self.solved[key] = done[0]
                self.solve_s += done[1]
        if key not in self.solved:
            traced, fwd = self._trace(b)
            t0 = time.perf_counter()
            axes = inner_axes(cp, tp, inside) or [("tp", 1)]
            cand = Candidate(tuple(d for _, d in axes), tuple(n for n, _ in axes), (),
                             cp_axes=(axes.index(("cp", cp)),) if cp > 1 else ())
            if (b, tp, cp, inside) not in self.spaces:  # shared by the sp on/off solves
                self.spaces[(b, tp, cp, inside)] = unpinned_space(traced, cand, self.config)
            # (the gradients' reduction over cp is left to the step end: price_setup)
            space, costs, res = solve_space(traced, self.mesh, self.config, cand,
                                            self.cost_passes, None,
                                            sequence_parallel=sp if tp > 1 else None,
                                            base_space=self.spaces[(b, tp, cp, inside)],
                                            gradient_share=0.0 if cp > 1 else 1.0,
                                            price_memo=self._priced)
            self.solved[key] = layer_costs(traced, fwd, space, costs, res.choice, self.num_blocks,
                                           self.config.optimizer, (tp if sp else 1) * cp,
                                           self.lead_runs, self.config.expert_load_skew,
                                           boundary_shards=cp)
            self.solve_s += time.perf_counter() - t0
        return self.solved[key]

    def shards_sequence(self, b: int) -> bool:
        """Whether sequence parallelism changes anything in this model: its trace has a layer
        norm op for it to split (:data:`~autopar.planning.records.NORMS`; a norm written out
        in pointwise ops, as DeepSeek-V3's RMSNorm, has none), so that a setup with it is not
        the same program as one without, priced as if its block inputs were split."""
        return self.facts(b).shards_sequence

    def facts(self, b: int, flops: bool = False) -> TraceFacts:
        """What the trace of microbatch size ``b`` tells besides its layer ILPs (asked once per
        setup priced: the graph walked once per size); its FLOPs counted only when ``flops``
        asks for them (or a worker counted them)."""
        if b not in self._facts and self.ahead is not None:
            done = self.ahead.take_facts(b)
            if done is not None:
                self._facts[b] = done[0]
                self.trace_s += done[1]
        if b not in self._facts:
            traced, _ = self._trace(b)
            self._facts[b] = TraceFacts(any(is_op(n, NORMS) for n in traced.gm.graph.nodes))
        if flops and self._facts[b].flops is None:
            self._facts[b] = dataclasses.replace(self._facts[b],
                                                 flops=_trace_flops(self, self._trace(b)[0]))
        return self._facts[b]

    def bound(self, setup: Setup, budget_bytes: float) -> StepCost:
        """A lower bound of ``setup``'s price, for a setup with ``cp > 1`` or ``tp > 1``, from
        layer costs solved more cheaply: without cp (once per (tp, b, sp)) or, without cp, on
        one device (tp = 1). A rank on the cp or tp axis computes and holds at least 1/cp (1/tp)
        of each layer's work and values, and communicates nothing there at least; it holds the
        parameters whole on cp, at least 1/tp of them on tp. The closed form only adds and
        takes maxima of these, so, with the same blocks per stage, the bound is below the
        setup's price; the balanced split is a greedy choice made on the lower costs, which may
        differ from the setup's (not proven below then; checked on the candidates of a small
        GPT pipeline in ``tests/unit/test_search.py``). A setup whose bound is no better than
        the best found so far need not have its layer ILP solved."""
        if setup.cp > 1:
            lc = self.costs(setup.tp, setup.microbatch_size, setup.sequence_parallel, 1)
            k, held = setup.cp, 1
        else:
            lc = self.costs(1, setup.microbatch_size, False, 1)
            k = held = setup.tp
        topo, none = self.mesh.topology, ExpertsWork(0.0, 0.0, 0.0)

        def flops_only(w: ExpertsWork) -> float:
            return ExpertsWork(w.flops / k, 0.0, 0.0, itemsize=w.itemsize).seconds(topo)

        def share(u: UnitCosts) -> UnitCosts:
            # (MoE experts, whose weights' traffic shrinks with ep: their FLOPs only, without
            # load skew; their all-to-alls left out)
            xf, xb = u.expert_forward_work.seconds(topo), u.expert_backward_work.seconds(topo)
            return dataclasses.replace(
                u, forward_s=max(0.0, u.forward_s - u.forward_comm_s - xf) / k
                + flops_only(u.expert_forward_work),
                backward_s=max(0.0, u.backward_s - u.backward_comm_s - xb) / k
                + flops_only(u.expert_backward_work),
                expert_forward_bytes=(), expert_backward_bytes=(), expert_forward_work=none,
                expert_backward_work=none, expert_forward_comm_s=0.0,
                # (full recomputation does not run the experts again: what the bound puts in
                # forward_s for them is taken out again there)
                expert_forward_s=flops_only(u.expert_forward_work),
                forward_comm_s=0.0, backward_comm_s=0.0, activation_bytes=u.activation_bytes / k,
                regathered_bytes=u.regathered_bytes / k,
                backward_transient_bytes=u.backward_transient_bytes / k,
                attention_forward_s=u.attention_forward_s / k,
                attention_bytes=u.attention_bytes / k, random_bytes=u.random_bytes / k,
                recompute_peak_bytes=tuple((p, v / k) for p, v in u.recompute_peak_bytes),
                state_bytes=u.state_bytes / held, param_elements=u.param_elements / held,
                expert_elements=u.expert_elements / held,
                expert_state_bytes=u.expert_state_bytes / held)

        pre = share(lc.pre)
        # (the leading blocks' recomputation: none re-run, all their values dropped, at least)
        low = dataclasses.replace(lc, pre=pre, block=share(lc.block), post=share(lc.post),
                                  input_bytes=lc.input_bytes / k,
                                  boundary_bytes=lc.boundary_bytes / k,
                                  tied_state_bytes=lc.tied_state_bytes / held,
                                  tied_elements=lc.tied_elements / held, lead_forward_s=0.0,
                                  lead_activation_bytes=pre.activation_bytes)
        # (as the search prices a pipeline: the better of balanced and even stages)
        return min((price_setup(low, dataclasses.replace(setup, even_split=e), topo, budget_bytes)
                    for e in ((False, True) if setup.pp > 1 else (False,))),
                   key=lambda c: c.step_time_s)

    def price(self, setup: Setup, budget_bytes: float | None = None) -> StepCost:
        """Price one ``setup`` (e.g. a hand-tuned configuration) with this model's layer costs."""
        topo = self.mesh.topology
        budget = budget_bytes if budget_bytes is not None else (
            self.config.memory_bytes if self.config.memory_bytes is not None else topo.memory_bytes)
        return price_setup(self.costs(*layer_key(setup)), setup, topo, budget)

    def _trace(self, b: int) -> tuple[Any, Any]:
        if b not in self.traces:
            if self.ahead is not None:
                self.ahead.claim(b)
            t0 = time.perf_counter()
            inputs = first_microbatch(self.example_inputs, self.batch // b)
            key = (model_fingerprint(self.model, inputs), self.config.mixed_precision == "bf16")
            if key not in _TRACES:
                while len(_TRACES) >= _TRACE_CACHE_SIZE:
                    _TRACES.pop(next(iter(_TRACES)))
                _TRACES[key] = capture_with_forward(self.model, inputs, self.config.mixed_precision)
            self.traces[b] = _TRACES[key]
            self.trace_s += time.perf_counter() - t0
        return self.traces[b]


def two_block_copy(model: nn.Module) -> tuple[nn.Module, str, int, tuple[int, ...]]:
    """A shallow copy of ``model`` whose block list holds one block of each run of identical
    leading blocks that differ from the rest (:func:`~autopar.capture.layers.leading_blocks`,
    none for most models; DeepSeek-V3's three dense first layers are one run) and two of the
    repeated ones (the weights are shared, not copied); the list's path, the model's number of
    repeated blocks and the lengths of the leading runs."""
    prefix = block_prefix([n for n, _ in model.named_parameters(remove_duplicate=False)])
    if prefix is None:
        raise PlanError(f"the cluster search prices a model by its repeated blocks (an "
                        f"nn.ModuleList of layers); {type(model).__name__} has none. Plan it with "
                        f"autopar.plan(model, mesh, example_inputs) instead.")
    blocks = model.get_submodule(prefix)
    lead = leading_blocks(model)
    if lead < 0:
        raise PlanError(f"the blocks of {prefix!r} differ other than in a leading run; the "
                        f"cluster search needs identical blocks after the first few. Plan it "
                        f"with autopar.plan(...) instead.")
    firsts, runs = [], []
    for j, b in enumerate(list(blocks)[:lead]):
        if runs and block_fingerprint(b) == block_fingerprint(blocks[firsts[-1]]):
            runs[-1] += 1
        else:
            firsts.append(j)
            runs.append(1)
    root = with_blocks(model, prefix, [blocks[j] for j in firsts] + list(blocks)[lead:lead + 2])
    return root, prefix, len(blocks) - lead, tuple(runs)


def search_unsupported(model: nn.Module, example_inputs: Any, mesh: Mesh,
                       config: Config) -> str | None:
    """Why the setup search cannot price ``model`` on ``mesh`` under ``config`` (``None``: it
    can): it needs two or more identical blocks in an ``nn.ModuleList``, inputs of one batch
    size, and a schedule it prices (1F1B, interleaved 1F1B)."""
    if mesh.size == 1:
        return "one device: there is no setup to search"
    if config.schedule not in (None, "1f1b", "interleaved-1f1b"):
        return f"schedule {config.schedule!r} (the search prices 1f1b and interleaved-1f1b)"
    node = mesh.topology.gpus_per_node
    if config.tp is not None and config.tp not in tp_degrees(mesh.size, node):
        return (f"tp={config.tp} on nodes of {node} devices (the search forms tp groups inside "
                f"a node, or of whole nodes up to {TP_ACROSS_NODES_MAX} devices)")
    prefix, count, kinds = identical_blocks(model)
    if prefix is None:
        return f"{type(model).__name__} has no list of repeated blocks"
    if count < 2:
        return f"{prefix!r} is not a list of two or more blocks"
    if kinds > 1 and leading_blocks(model) < 0:
        return f"the blocks of {prefix!r} differ (other than a leading run)"
    try:
        batch_size(example_inputs)
    except PlanError as e:
        return str(e)
    return None


def pipelines_always(config: Config, mesh: Mesh) -> bool:
    """Whether pipelined setups are searched even when a setup without one fits: when asked
    (``Config.pp > 1``) or when the mesh spans nodes (where Megatron-LM puts pipeline stages,
    keeping tensor parallelism on a node's links). On one node tensor and data parallelism over
    the node's links beat a pipeline's bubble, and the pipelined setups (a trace per
    microbatch size) are searched only when nothing else fits."""
    return (config.pp is not None and config.pp > 1) or mesh.nodes > 1


def search(model: nn.Module, example_inputs: Any, mesh: Mesh, config: Config | None = None,
           cost_passes: Sequence[Callable[..., Any]] = (),
           progress: Callable[[str], None] | None = None,
           layers: "LayerSolver | None" = None,
           replica_microbatches: Sequence[int] | None = None) -> SearchResult:
    """Search every setup of :func:`candidate_setups` for ``model`` on ``mesh`` and rank them
    (those :func:`~autopar.planning.setups.tried_last` says only if no other fits).

    ``example_inputs`` is one global batch (its dim 0 is the global batch size); ``model`` may
    live under ``FakeTensorMode``. Raises :class:`PlanError` when nothing fits, naming the
    smallest memory any setup needs.
    """
    config = config or Config()
    t0 = time.perf_counter()
    rep = layers or LayerSolver(model, example_inputs, mesh, config, cost_passes)
    topo = mesh.topology
    budget = config.memory_bytes if config.memory_bytes is not None else topo.memory_bytes
    setups = list(candidate_setups(mesh.size, topo.gpus_per_node, rep.batch, rep.num_blocks,
                                   config, replica_microbatches=replica_microbatches,
                                   seq=rep.seq, experts=rep.num_experts))
    deferred = [tried_last(s, config) for s in setups]
    last = [s for s, d in zip(setups, deferred) if d]
    setups = [s for s, d in zip(setups, deferred) if not d]
    later = [] if pipelines_always(config, mesh) else [s for s in setups if s.pp > 1]
    # without context parallelism first: the best of those bounds the setups with it
    # (LayerSolver.bound), whose (cp, tp) layer ILPs are the search's dearest; the smallest
    # microbatches first (the likeliest to fit: a setup that fits bounds those with tp > 1)
    order = lambda s: (s.cp > 1, s.microbatch_size)  # noqa: E731
    queue = sorted((s for s in setups if s not in later), key=order)
    later.sort(key=order)
    workers = 0
    try:
        rep.ahead = start_ahead(rep, setups + last, config)
        workers = len(rep.ahead.procs) if rep.ahead is not None else 0
        done = _price_all(rep, queue, later, config, budget, progress)
        if not done.ranked and last:  # (setups.tried_last)
            done = done.then(_price_all(rep, sorted(last, key=order), [], config, budget,
                                        progress))
    finally:
        if rep.ahead is not None:
            for b, (facts, seconds) in rep.ahead.facts_received().items():
                if b not in rep._facts:  # (the FLOPs of the sizes traced there: model_flops)
                    rep._facts[b] = facts
                    rep.trace_s += seconds
            rep.ahead.close()
            rep.ahead = None
    ranked, pruned = done.ranked, done.pruned
    if not ranked:  # (priced after all, for the smallest need the error names)
        pruned = pruned + tuple(_price_either_split(rep, st, budget) for st in done.over)
    ranked = _ranked_or_raise(list(ranked), list(pruned), mesh, rep.batch, config, budget)
    timings = {"trace_s": rep.trace_s, "layer_ilp_s": rep.solve_s, "price_s": done.price_s,
               "total_s": time.perf_counter() - t0, "workers": workers}
    return SearchResult(tuple(ranked), tuple(pruned), len(ranked) + len(pruned) + len(done.over),
                        len(rep.solved), timings, mesh.size, done.bounded, done.over, done.twins)


def start_ahead(rep: LayerSolver, setups: Sequence[Setup], config: Config
                ) -> AheadSolver | None:
    """Workers solving ``setups``' layer costs ahead of the search (:mod:`~autopar.planning.
    ahead`): every key of theirs without cp, with the one-device keys the bound of a tp > 1
    setup reads (with cp: the keys without it that their bound reads), of every microbatch
    size but the smallest, which the search traces now, first. ``None`` (nothing started) with
    ``rep.workers`` below 1, where forking is not safe (:func:`~autopar.planning.ahead.
    fork_is_safe`), with one microbatch size, a model under :data:`AHEAD_MIN_PARAMS`
    parameters or a first trace under :data:`AHEAD_AFTER_S` seconds (where forking would cost
    more than it saves)."""
    keys: set[LayerKey] = set()
    for s in setups:
        b = s.microbatch_size
        keys.add(layer_key(s) if s.cp == 1 else (s.tp, b, s.sequence_parallel, 1, False))
        if s.cp == 1 and s.tp > 1:
            keys.add((1, b, False, 1, False))
    sizes = sorted({k[1] for k in keys})
    if rep.workers < 1 or len(sizes) < 2 or rep.params < AHEAD_MIN_PARAMS or \
            not fork_is_safe():
        return None
    t0 = time.perf_counter()
    rep.facts(sizes[0])
    if time.perf_counter() - t0 < AHEAD_AFTER_S:
        return None
    keys = {k for k in keys if k[1] != sizes[0] and k not in rep.solved}
    return AheadSolver(rep, sorted(keys), min(rep.workers, len(sizes) - 1),
                       skip_unsplit=config.sequence_parallel is None,
                       time_limit_s=config.solver_time_limit_s)


@dataclass(frozen=True)
class _Priced:
    """What :func:`_price_all` found: the setups that fit, those priced that do not, those
    whose :func:`~autopar.cost_models.step_price.memory_floor` is over the budget (not priced),
    how many its bound skipped, the seconds spent pricing, and how many were not priced as a
    lighter twin fits (:class:`~autopar.planning.setups.Twins`)."""

    ranked: tuple[StepCost, ...]
    pruned: tuple[StepCost, ...]
    over: tuple[Setup, ...]
    bounded: int
    price_s: float
    twins: int = 0

    def then(self, more: "_Priced") -> "_Priced":
        """This pass followed by ``more``."""
        return _Priced(self.ranked + more.ranked, self.pruned + more.pruned,
                       self.over + more.over, self.bounded + more.bounded,
                       self.price_s + more.price_s, self.twins + more.twins)


def _price_all(rep: LayerSolver, queue: list[Setup], later: list[Setup], config: Config,
               budget: float, progress: Callable[[str], None] | None) -> _Priced:
    """Price the setups of ``queue`` in order, then those of ``later`` (pipelines on one node)
    if none of ``queue`` fits. A setup whose training state alone is over the budget
    (:func:`~autopar.cost_models.step_price.memory_floor`) is set aside unpriced. A setup
    skipped by its bound (:meth:`LayerSolver.bound`) whose layer ILP another setup solved
    after all is priced at the end (cheaply), so that :func:`only_when_needed` sees every
    twin that fits. A setup with a twin doing less recomputation or ZeRO that fits is not
    priced: :func:`only_when_needed` would drop it (``candidate_setups`` yields the lighter
    twins first: recomputation, then ZeRO, outside the other choices). The best step found so
    far, which the bound is held against, is taken only from setups that
    :func:`only_when_needed` keeps: none with a lighter twin that fits (not priced) or that
    its bound skipped (which may be priced at the end, fit and drop it)."""
    ranked: list[StepCost] = []
    pruned: list[StepCost] = []
    skipped: list[Setup] = []
    over: list[Setup] = []
    price_s, best_s, n, twins = 0.0, float("inf"), 0, 0
    fitting, held = Twins(), Twins()  # (those that fit; those skipped by their bound)
    topo = rep.mesh.topology
    while queue or (later and not ranked):
        if not queue:  # nothing fits without a pipeline
            queue, later = later, []
        setup = queue.pop(0)
        n += 1
        if setup.sequence_parallel and config.sequence_parallel is None and \
                not rep.shards_sequence(setup.microbatch_size):
            continue  # (the same program as its twin without it, which is priced; when forced,
            # the plan is refused later, saying why: entry._check_forced)
        if fitting.has_lighter(setup):  # (only_when_needed would drop it)
            twins += 1
            continue
        if (setup.cp > 1 or (setup.tp > 1 and layer_key(setup) not in rep.solved)) and \
                best_s < float("inf") and rep.bound(setup, budget).step_time_s >= best_s:
            skipped.append(setup)
            held.add(setup)
            continue
        lc = rep.costs(*layer_key(setup))
        t1 = time.perf_counter()
        if memory_floor(lc, setup, topo) > budget:
            over.append(setup)
            price_s += time.perf_counter() - t1
            continue
        cost = _price_either_split(rep, setup, budget)
        price_s += time.perf_counter() - t1
        (ranked if cost.fits else pruned).append(cost)
        if cost.fits:
            fitting.add(cost.setup)
            if not held.has_lighter(cost.setup):  # (else only_when_needed may drop it)
                best_s = min(best_s, cost.step_time_s)
        if progress and n % 500 == 0:
            best = min(ranked, key=lambda c: c.step_time_s) if ranked else None
            progress(f"{n} setups priced, {len(rep.solved)} layer ILPs solved; best so far: "
                     + (f"{best.setup.describe()} {best.step_time_s:.3f} s" if best else "none fits"))
    late = [st for st in skipped if layer_key(st) in rep.solved]
    dropped = [st for st in late if fitting.has_lighter(st)]
    late = [st for st in late if not fitting.has_lighter(st)]
    aside = {st for st in late if memory_floor(rep.costs(*layer_key(st)), st, topo) > budget}
    over += [st for st in late if st in aside]
    priced = [_price_either_split(rep, st, budget) for st in late if st not in aside]
    return _Priced(tuple(ranked + [c for c in priced if c.fits]),
                   tuple(pruned + [c for c in priced if not c.fits]), tuple(over),
                   len(skipped) - len(late) - len(dropped), price_s, twins + len(dropped))


def _price_either_split(rep: LayerSolver, setup: Setup, budget: float) -> StepCost:
    """``setup``'s price with its stages balanced by time, or with a pipeline the same blocks
    per stage (as Megatron-LM) when that is better (or fits where the other does not)."""
    cost = rep.price(setup, budget)
    if setup.pp > 1:
        even = rep.price(dataclasses.replace(setup, even_split=True), budget)
        cost = min(cost, even, key=lambda c: (not c.fits, c.step_time_s))
    return cost


def _ranked_or_raise(ranked: list[StepCost], pruned: list[StepCost], mesh: Mesh, batch: int,
                     config: Config, budget: float) -> list[StepCost]:
    """The setups that fit, best first, recomputation and ZeRO only where needed
    (:func:`only_when_needed`); raises :class:`PlanError` when no setup matches the batch and
    the config, ``InfeasibleMemoryError`` (naming the smallest need) when none fits."""
    if not ranked and not pruned:
        raise PlanError(f"no setup of {mesh.size} devices matches the batch of {batch} and "
                        f"the config {config}; choose a batch divisible by the data-parallel "
                        f"degree or relax the config.")
    ranked = only_when_needed(ranked)
    ranked.sort(key=lambda c: (c.step_time_s, max(c.rank_memory_bytes)))
    if not ranked:
        need = min(max(c.rank_memory_bytes) for c in pruned)
        from autopar.solver.ilp import InfeasibleMemoryError

        raise InfeasibleMemoryError(
            f"no setup fits {budget / 2**30:.1f} GiB per device on {mesh.size} devices; the "
            f"smallest needs {need / 2**30:.1f} GiB. Use more devices or a smaller batch.",
            required_bytes=need, budget_bytes=budget)
    return ranked


def model_flops(layers: LayerSolver, b: int) -> float:
    """The model's FLOPs for one microbatch of ``b`` samples (forward and backward, without
    recomputation), from the two-block trace: everything outside the repeated blocks (the
    leading ones included) plus the number of repeated blocks times the second one's count."""
    return layers.facts(b, flops=True).flops


def _trace_flops(layers: LayerSolver, traced: Any) -> float:
    """:func:`model_flops` of the two-block trace ``traced``."""
    kept = len(layers.lead_runs)
    of = lambda j: {n for n, layer in traced.node_layer.items()  # noqa: E731
                    if layer == f"{layers.prefix}.{j}"}
    block, first = of(kept + 1), of(kept)
    per_block = graph_flops(traced.gm, block)
    rest = graph_flops(traced.gm) - graph_flops(traced.gm, block | first)
    # (each leading block traced stands for its run)
    rest += sum((c - 1) * graph_flops(traced.gm, of(j)) for j, c in enumerate(layers.lead_runs))
    return rest + layers.num_blocks * per_block


def pruned_examples(result: SearchResult, limit: int = 3) -> list[str]:
    """A few setups pruned for memory, one per (dp, tp, pp), with the reason."""
    seen, out = set(), []
    for c in result.pruned:
        key = (c.setup.dp, c.setup.tp, c.setup.pp)
        if key not in seen:
            seen.add(key)
            out.append(f"{c.setup.describe()}: {c.reason()}")
        if len(out) == limit:
            break
    return out

"""Activation recomputation policies: which forward values of a joint graph are recomputed.

Policies (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys'23, sec. 4 and 5):

- ``"none"``: every forward value the backward reads stays alive until then.
- ``"selective"``: the attention core is recomputed: the fused attention op
  (``scaled_dot_product_attention``) or, for explicit attention, every value of the softmax's
  shape (scores, masked scores, probabilities). Their s x s outputs are the 5as/h term of the
  paper's per-layer activation memory sbh(34 + 5as/h).
- ``"full"``: each repeated block keeps only its input and re-runs its forward in the backward
  (the paper's "full activation recomputation", sec. 2 and Table 2).

Two values are never recomputed and are saved instead: outputs of random ops (dropout, whose mask
must be the forward's; autopar does not replay the RNG) and, in a lowered program, outputs of
collectives (re-running them would add communication the plan does not price; torch's own
partitioner saves them too).

:func:`recompute_nodes` picks the joint-graph nodes for a policy; the planner prices the choice
with it (``cost_models.sharding``) and :func:`autopar.passes.recompute.recompute_pass` carries it
out on the lowered per-rank program.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Iterable, Iterator

import torch
import torch.fx as fx

import autopar.capture.moe  # noqa: F401  (registers autopar::experts)
from autopar.capture.layers import aten_ops, is_backward, is_op
from autopar.graph import TracedGraph

__all__ = ["POLICIES", "REGATHER", "TAG", "is_comm", "is_forward", "is_random", "is_regather",
           "is_wait", "marked", "recompute_nodes", "regather_layer", "gather_bucket_key", "gather_dtype", "regathered_nodes", "zero_gathers", "GatherRuns"]

POLICIES = ("none", "selective", "full")
TAG = "recompute"  # the metadata key torch's tracing copies from a node to the nodes it produces
# under ZeRO (no pipeline), the key in a lowered node's ``meta["custom"]`` (which torch's tracing copies too)
# marking a node that makes a parameter's gathered copy from its shard: the gathers of a
# ``regathered_nodes`` value and that chain's views and casts, in the forward and the backward;
# its value is the layer of the reader the copy is made for
REGATHER = "autopar_regather"

_RANDOM = aten_ops("native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like",
                   "randint", "randint_like", "randperm", "normal", "uniform", "multinomial",
                   "dropout")
_WAIT = frozenset({torch.ops._c10d_functional.wait_tensor})
_SOFTMAX = aten_ops("_softmax", "softmax", "_safe_softmax")  # (the last: SDPA's math path)
_ATTENTION = aten_ops("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                      "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_fused_attention_overrideable")
_ALIAS = {operator.getitem} | aten_ops("view", "_unsafe_view", "t", "transpose", "permute",
                                       "expand", "detach", "alias", "unsqueeze", "squeeze",
                                       "reshape", "slice", "select", "split", "unbind")


def is_random(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers (its recomputation would not reproduce its value), or
    is a view or ``getitem`` of such a value (re-running it would re-run the draw)."""
    if n.op != "call_function":
        return False
    if is_op(n, _RANDOM) or bool(getattr(n.target, "is_random", False)):
        return True
    return is_op(n, _ALIAS) and bool(n.all_input_nodes) and is_random(n.all_input_nodes[0])


@contextlib.contextmanager
def marked(key: str, value: object) -> Iterator[None]:
    """Mark the nodes traced inside (by the lowering, under ``fx.traceback``'s current node
    metadata) with ``meta["custom"][key] = value`` (torch's tracing copies ``custom`` to the
    nodes it makes); ``None`` marks nothing."""
    meta = torch.fx.traceback.get_current_meta()
    if value is None or meta is None:
        yield
        return
    old = meta.get("custom")
    meta["custom"] = {**(old or {}), key: value}
    try:
        yield
    finally:
        if old is None:
            meta.pop("custom", None)
        else:
            meta["custom"] = old


def is_comm(n: fx.Node) -> bool:
    """Whether ``n`` is a functional collective of a lowered program (or a collective's wait)."""
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"


def is_wait(n: fx.Node) -> bool:
    """Whether ``n`` waits for a functional collective (``_c10d_functional.wait_tensor``)."""
    return is_op(n, _WAIT)


def is_regather(n: fx.Node) -> bool:
    """Whether lowered node ``n`` makes a ZeRO parameter's gathered copy (:data:`REGATHER`)."""
    return regather_layer(n) is not None


def regather_layer(n: fx.Node) -> str | None:
    """The layer whose reader lowered node ``n`` makes a ZeRO-3 parameter's gathered copy for
    (:data:`REGATHER`; ``""`` outside repeated layers), or ``None`` for another node."""
    return (n.meta.get("custom") or {}).get(REGATHER)


class GatherRuns:
    """ZeRO-3's prefetch (the rule of the runtime's ``passes.overlap.prefetch_gathers`` and of
    the plan's walks of the same program, ``planning.collectives`` and
    ``cost_models.liveness``): in each part of the step, the parameter gathers fall into runs of
    consecutive gathers for readers of one layer; the first run is issued together where its
    first gather was made, and each later run together where the run before it was first
    needed, so a layer's gathers travel while the layer before it computes (FSDP2's prefetch of
    the next layer: Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3.3) and two layers' gathered
    copies are alive at once (``cost_models.sharding.REGATHERED_LAYERS``).

    Feed the gathers of one part in program order to :meth:`issue`, each with a position token
    of the caller's (a node, a step); it answers the token of the position the gather is issued
    at and whether that is ahead of its run's own first gather."""

    def __init__(self) -> None:
        self.firsts: list[tuple[str, object]] = []  # per run: (layer, token of its first gather)

    def issue(self, layer: str, token: object) -> tuple[object, bool]:
        """Where the gather at ``token``, for a reader in ``layer``, is issued."""
        if not self.firsts or self.firsts[-1][0] != layer:
            self.firsts.append((layer, token))
        k = len(self.firsts) - 1
        return self.firsts[max(k - 1, 0)][1], k > 0

    @property
    def run(self) -> tuple[int, object]:
        """The index of the run the last gather fed to :meth:`issue` is in, and the token of
        that run's first gather (where the run is first needed: its flat bucket is copied
        out there, ``passes.gather_buckets``)."""
        return len(self.firsts) - 1, self.firsts[-1][1]


def gather_bucket_key(part: str, layer: str, group: object, dtype: torch.dtype) -> tuple:
    """What consecutive ZeRO-3 parameter gathers share to travel as one flat all-gather (the
    runtime's ``passes.gather_buckets``; the plan's walk, ``planning.collectives``, merges its
    gathers by the same key): the part of the step, the layer of their readers (one run of
    :class:`GatherRuns`), the process group (mesh axis) and the dtype."""
    return (part, layer, group, dtype)


def is_forward(n: fx.Node) -> bool:
    """Whether ``n`` calls an op in the forward part of a joint program."""
    return n.op == "call_function" and not is_backward(n)


def _numel(n: fx.Node) -> int | None:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.numel() if isinstance(val, torch.Tensor) else None


def recompute_nodes(traced: TracedGraph, policy: str) -> frozenset[str]:
    """Names of the joint graph's forward nodes that ``policy`` recomputes in the backward."""
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r}: use one of {POLICIES}.")
    if policy == "none":
        return frozenset()
    layer = traced.node_layer
    fwd = [n for n in traced.gm.graph.nodes if is_forward(n) and layer.get(n.name)]
    if policy == "full":
        # a block's values, except those read outside it (the block's output): they are saved;
        # an MoE experts op is never run again (its backward op takes its inputs, not it)
        picked = {n.name for n in fwd if not is_random(n) and n.target is not _EXPERTS and all(
            u.op == "call_function" and (layer.get(u.name) == layer[n.name] or not is_forward(u))
            for u in n.users)}
    else:
        picked = _attention_core(fwd, layer)
    return frozenset(_with_aliases(traced.gm.graph.nodes, picked))


_MATMUL = aten_ops("mm", "bmm", "matmul", "baddbmm", "addmm")
_EXPERTS = torch.ops.autopar.experts.default
_CASTS = aten_ops("_to_copy", "to", "type_as")


def regathered_nodes(traced: TracedGraph) -> frozenset[str]:
    """What ZeRO-3 makes again in the backward (Rajbhandari et al., SC'20, sec. 5.3: a
    parameter's shard is gathered for its forward, freed after it, gathered again for its
    backward): the parameters' placeholders and the forward nodes computed from one of them
    through views and dtype casts alone (``t``, autocast's ``_to_copy``). A backward read of
    any of them re-runs that chain from the parameter's shard, with its gathers, right before
    the reader, so the forward's gathered copy is freed after its last forward reader.
    ``getitem`` and random ops are never in a chain."""
    chain = {p.node for p in traced.params}
    for n in traced.gm.graph.nodes:
        if is_forward(n) and n.target is not operator.getitem and (
                is_op(n, _ALIAS) or is_op(n, _CASTS)) and len(n.all_input_nodes) == 1 \
                and n.all_input_nodes[0].name in chain:
            chain.add(n.name)
    return frozenset(chain)


def gather_dtype(param: fx.Node) -> torch.dtype:
    """The dtype a pipeline stage gathers the parameter of placeholder ``param`` in: the
    narrower dtype its program casts it to, when every reader of it is such a cast (bf16
    autocast's ``_to_copy`` before a matmul): the shard is cast before the gather, which gives
    the same copy bit for bit with fewer bytes moved and held (the ZeRO paper's mixed-precision
    setup, Rajbhandari et al., SC'20, sec. 3: fp32 master shards, fp16 parameters gathered);
    else its own dtype. The program then casts a tensor already of that dtype (a copy)."""
    own = param.meta["val"].dtype
    casts = [u for u in param.users if is_forward(u) and u.target is torch.ops.aten._to_copy.default
             and isinstance(u.meta.get("val"), torch.Tensor)]
    dtypes = {u.meta["val"].dtype for u in casts}
    if not casts or len(casts) != len(param.users) or len(dtypes) != 1:
        return own
    (cast,) = dtypes
    return cast if cast.itemsize < own.itemsize else own


def zero_gathers(traced: TracedGraph, zero: int) -> tuple[frozenset[str], frozenset[str]]:
    """The ZeRO chains of a plan without a pipeline (:func:`regathered_nodes`): those whose
    gathers are issued a layer ahead and merged per layer (:class:`GatherRuns`,
    ``passes.gather_buckets``; every ZeRO stage, as each stores its parameters sharded), and
    those gathered again for the backward (ZeRO-3 alone)."""
    chains = regathered_nodes(traced) if zero else frozenset()
    return chains, chains if zero == 3 else frozenset()


def _attention_core(fwd: list[fx.Node], layer: dict[str, str]) -> set[str]:
    """Fused attention ops, and for each softmax its block's chain from the scores matmul
    (``QK^T``) through scaling and masking to the softmax and what follows it up to the matmul
    with ``V`` (not included): the values of the softmax's shape, through views."""
    fwd_set = set(fwd)
    picked = {n.name for n in fwd if is_op(n, _ATTENTION)}
    for sm in (n for n in fwd if is_op(n, _SOFTMAX)):
        shape, size = _shape(sm), _numel(sm)

        def joins(m: fx.Node) -> bool:
            """Same block, same size, and the softmax's shape (or a view, or the scores matmul)."""
            return (m in fwd_set and layer[m.name] == layer[sm.name] and _numel(m) == size
                    and not is_random(m) and m.name not in picked
                    and (_shape(m) == shape or is_op(m, _ALIAS) or is_op(m, _MATMUL)))

        picked.add(sm.name)
        up, down = [sm], [sm]
        while up:  # back to the scores matmul, which is taken and not gone past
            for a in up.pop().all_input_nodes:
                if joins(a):
                    picked.add(a.name)
                    if not is_op(a, _MATMUL):
                        up.append(a)
        while down:  # on to the matmul with V, which is not taken
            for u in down.pop().users:
                if joins(u) and not is_op(u, _MATMUL):
                    picked.add(u.name)
                    down.append(u)
    return picked


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _with_aliases(nodes: Iterable[fx.Node], picked: set[str]) -> set[str]:
    """Add the views and getitems of picked nodes: a saved view would keep its base alive."""
    out = set(picked)
    for n in nodes:
        if is_forward(n) and n.name not in out and is_op(n, _ALIAS) and \
                n.all_input_nodes and n.all_input_nodes[0].name in out:
            out.add(n.name)
    return out

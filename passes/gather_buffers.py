"""Gather into the program's own buffers: every functional all-gather of a lowered program
writes into an output the program allocates (``all_gather_into_tensor_out``).

Why: torch 2.13's gloo process group runs a group's collectives on two worker threads, and each
worker, after a collective, records the collective's name in the group's status
(``ProcessGroupGloo::runLoop``: ``pgStatus_->lastCompletedWorkName = opTypeToString(...)``)
without holding the group's lock. Two all-gathers finishing at once on one group race on that
``std::string``; a name longer than the string's inline capacity of 15 characters lives on the
heap, and both workers free the same buffer. The functional ``all_gather_into_tensor`` runs as
``allgather_into_tensor_coalesced`` (``ALLGATHER_COALESCED``, 19 characters): with several
gathers in flight (ZeRO's parameter gathers, sequence parallelism's, prefetch) the heap was
corrupted now and then (``malloc(): unaligned tcache chunk detected``, SIGSEGV in a later
``malloc``; found with AddressSanitizer preloaded: "attempting double-free ... in
ProcessGroupGloo::runLoop", a 20-byte string freed by both workers). The ``_out`` form runs as
``_allgather_base``, whose name (``ALLGATHER``) is stored inline: nothing on the heap to free
twice. The collective, its bytes and its result are the same, on NCCL too.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from autopar import _torch_private as private

__all__ = ["gather_into_buffers", "all_gather_into_buffer", "compilable"]

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default


def all_gather_into_buffer(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """``all_gather_into_tensor(x, group_size, group_name)`` into a new buffer (module
    docstring); wait for the result with ``wait_tensor`` as for the functional op."""
    out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]) if x.dim() else (group_size,))
    return _GATHER_OUT(x, group_size, group_name, out=out)


def gather_into_buffers(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every ``all_gather_into_tensor`` node by an ``empty`` buffer of its output's
    shape and ``all_gather_into_tensor_out`` into it (module docstring).

    Requires: a local program with ``meta["val"]`` on its collectives. Guarantees: the same
    collectives in the same order, with the same bytes and results; the new nodes keep the
    replaced node's metadata (its part of the step, its ZeRO-3 mark).
    """
    for n in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _GATHER]:
        val = n.meta["val"]
        with gm.graph.inserting_before(n):
            buf = gm.graph.call_function(torch.ops.aten.empty.memory_format, (list(val.shape),),
                                         {"dtype": val.dtype, "device": val.device})
            out = gm.graph.call_function(_GATHER_OUT, tuple(n.args), {"out": buf})
        buf.meta = dict(n.meta)
        out.meta = dict(n.meta)
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return gm


def compilable(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as inductor can compile it on the running torch. Torch 2.11's and 2.12's functionalization
    refuses ``all_gather_into_tensor_out`` (an op whose output aliases an input: "Found a custom
    (non-ATen) operator whose output has alias annotations"), so there a copy of ``gm`` gets
    every gather into a buffer back as the functional gather (:func:`gather_into_buffers`
    undone; the gloo race it avoids is possible again in their compiled programs). 2.13
    compiles ``gm`` as it is.

    Requires: a program of :func:`gather_into_buffers`. Guarantees: the same collectives, bytes
    and results.
    """
    if not private.older_than("2.13"):
        return gm
    gm = copy.deepcopy(gm)
    for n in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _GATHER_OUT]:
        buf = n.kwargs["out"]
        with gm.graph.inserting_before(n):
            gather = gm.graph.call_function(_GATHER, tuple(n.args))
        gather.meta = dict(n.meta)
        n.replace_all_uses_with(gather)
        gm.graph.erase_node(n)
        if not buf.users:
            gm.graph.erase_node(buf)
    gm.graph.lint()
    gm.recompile()
    return gm

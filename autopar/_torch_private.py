"""Every private PyTorch API that autopar uses, in one place, behind a version check.

PyTorch's private modules (DTensor's sharding propagator, AOTAutograd's joint export, the fake
process group) change between releases. autopar is verified against the releases listed in
``SUPPORTED``; importing it on another release raises an error that says so, rather than
failing later inside a planner with an obscure ``AttributeError``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "DTensorSpec", "TensorMeta", "OpSchema", "OpSpec", "OpStrategy", "RuntimeSchemaInfo",
    "TupleStrategy", "expand_to_full_mesh_op_strategy", "generate_redistribute_costs",
    "_StridedShard", "FakeTensor", "FakeTensorMode", "OpOverload", "OpOverloadPacket",
    "TorchDispatchMode", "funcol", "tree_flatten", "tree_map", "tree_map_only",
    "SUPPORTED", "TRIED",
    "check_torch_version",
    "RELEASE",
    "older_than",
    "sharding_propagator",
    "enumerate_op_strategy",
    "MeshExpansion",
    "MIXED_PARTIALS_DROPPED",
    "redistribute_local",
    "init_fake_process_group",
    "resolve_process_group",
    "process_group_options",
    "export_joint",
    "no_redistribute_costs",
    "partition_joint",
    "inductor_compile",
    "memory_tracker",
]

SUPPORTED = ("2.11", "2.12", "2.13")


def _release(version: str) -> str:
    """``"2.11.0+cu130"`` -> ``"2.11"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _as_tuple(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("."))


# the running torch release, "major.minor" (the rules that differ by release read it)
RELEASE = _release(torch.__version__)
# releases that run with AUTOPAR_UNVERIFIED_TORCH=1 but are not verified (a warning says so);
# none at present: 2.11 and 2.12 joined SUPPORTED once the suite passed on them (2026-11-27)
TRIED: tuple[str, ...] = ()


def older_than(release: str) -> bool:
    """Whether the running torch release is older than ``release`` (``"2.13"``): DTensor's
    sharding rules that autopar replaces on older releases are gated by it
    (:mod:`autopar.strategies.rules`)."""
    return _as_tuple(RELEASE) < _as_tuple(release)


def check_torch_version() -> None:
    """Raise ``RuntimeError`` unless the running torch release is one autopar was verified on
    (or one of ``TRIED`` with ``AUTOPAR_UNVERIFIED_TORCH=1`` set, which warns instead)."""
    import os
    import warnings

    release = _release(torch.__version__)
    if release in SUPPORTED:
        return
    if release in TRIED and os.environ.get("AUTOPAR_UNVERIFIED_TORCH") == "1":
        warnings.warn(f"autopar on torch {torch.__version__}: not verified (the suite passes on "
                      f"{', '.join(SUPPORTED)})", RuntimeWarning, stacklevel=2)
        return
    tried = f" (on {', '.join(TRIED)}, AUTOPAR_UNVERIFIED_TORCH=1 runs it unverified)" if TRIED else ""
    raise RuntimeError(
        f"autopar uses private PyTorch APIs verified on torch {', '.join(SUPPORTED)}; "
        f"found torch {torch.__version__}. Install torch==2.13.0 (see README){tried}."
    )


check_torch_version()

from torch._ops import OpOverload, OpOverloadPacket  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402
from torch.distributed.tensor._op_schema import (  # noqa: E402
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
import torch.distributed.tensor._ops.utils as op_utils  # noqa: E402
from torch.distributed.tensor._ops.utils import (  # noqa: E402
    expand_to_full_mesh_op_strategy,
    generate_redistribute_costs,
    is_tensor_shardable,
)
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from torch.distributed.tensor._ops.single_dim_strategy import (  # noqa: E402
    _expand_single_dim_strategy_to_mesh,
)
from torch.distributed.tensor._redistribute import redistribute_local_tensor  # noqa: E402


def sharding_propagator() -> Any:
    """DTensor's global sharding propagator (holds the per-op strategy registries)."""
    return DTensor._op_dispatcher.sharding_propagator


def has_rule(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor (or a rule autopar registered into it) knows a strategy for ``op``."""
    prop = sharding_propagator()
    return op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs


@dataclass(frozen=True)
class MeshExpansion:
    """A single-dim rule's strategies for one mesh axis, as DTensor hands them to
    ``expand_to_full_mesh_op_strategy`` (which builds every combination over the mesh's axes
    as specs, most of them then found uneven): captured instead, for autopar to expand with
    plain tuples (:mod:`autopar.strategies.expansion`).

    ``single_dim``: each strategy's placement per position, outputs then tensor inputs
    (``None``: no tensor there); ``num_outputs``: how many leading positions are outputs;
    ``input_shapes`` and ``input_placements``: each tensor input's shape and the one placement
    the schema gave it (DTensor keeps an uneven split equal to it where the rule allows
    uneven sharding); ``mesh``: the device mesh expanded over.
    """

    single_dim: tuple[tuple[Any, ...], ...]
    num_outputs: int
    input_shapes: tuple[tuple[int, ...], ...]
    input_placements: tuple[tuple[Any, ...], ...]
    allow_uneven_sharding: bool
    allow_unbacked_sharding: bool | None
    mesh: Any

    def shardable(self, index: int, placements: tuple[Any, ...]) -> bool:
        """Whether DTensor's expansion keeps input ``index`` at ``placements``
        (``is_tensor_shardable``, or the uneven rule's exception)."""
        spec = _PlacementsOnMesh(placements, self.mesh)
        return is_tensor_shardable(self.input_shapes[index], spec,  # type: ignore[arg-type]
                                   allow_unbacked_sharding=self.allow_unbacked_sharding) or (
            self.allow_uneven_sharding and placements == self.input_placements[index])


@dataclass(frozen=True)
class _PlacementsOnMesh:
    """What ``is_tensor_shardable`` reads of a ``DTensorSpec`` (building one costs tens of
    microseconds)."""

    placements: tuple[Any, ...]
    mesh: Any


# whether DTensor's expansion over the mesh drops a combination whose placements of one tensor
# mix partial kinds (sum with max, say; sum with avg of one type excepted): torch 2.13 does
# (``expand_to_full_mesh_op_strategy``'s ``has_mixed_partial``), 2.11 does not; None where not
# read (2.12): autopar.strategies.expansion then leaves such rules to DTensor
MIXED_PARTIALS_DROPPED: bool | None = {"2.11": False, "2.13": True}.get(RELEASE)

_EXPANSION_KWARGS = frozenset({"output_tensor_meta", "input_index", "inplace_op",
                               "allow_unbacked_sharding", "allow_uneven_sharding",
                               "is_valid_strategy_cb", "different_mesh_args"})


def _capture_expansion(original: Callable[..., Any], mesh: Any, op_schema: OpSchema,
                       single_mesh_dim_strategies: Any, **kwargs: Any) -> Any:
    """``expand_to_full_mesh_op_strategy`` as :func:`enumerate_op_strategy` calls it with
    ``capture=True``: the plain case returned as a :class:`MeshExpansion`; an in-place or
    out-variant op, a validity callback, arguments on other meshes or arguments this release
    does not name expanded by DTensor itself (``original``)."""
    inputs = op_schema.args_strategy + op_schema.kwargs_strategy
    if set(kwargs) - _EXPANSION_KWARGS or kwargs.get("inplace_op") or \
            kwargs.get("is_valid_strategy_cb") is not None or kwargs.get("different_mesh_args") \
            or op_schema.is_out_variant_op() or not inputs:
        return original(mesh, op_schema, single_mesh_dim_strategies, **kwargs)
    return MeshExpansion(
        tuple(tuple(s) for s in single_mesh_dim_strategies), kwargs.get("input_index", 1),
        tuple(tuple(i.shape) for i in inputs),
        tuple(tuple(i.strategies[0].output_spec.placements) for i in inputs),
        bool(kwargs.get("allow_uneven_sharding", False)), kwargs.get("allow_unbacked_sharding"),
        mesh)


def enumerate_op_strategy(
    op: torch._ops.OpOverload, schema: OpSchema, out_meta: Any, mesh: Any, capture: bool = False,
) -> OpStrategy | MeshExpansion | None:
    """All of DTensor's candidate strategies for ``op`` on ``mesh``.

    ``schema`` holds an ``OpStrategy`` for every tensor argument (the candidate placements of
    its producer). Returns ``None`` when DTensor has no rule for the op. ``capture``: a
    single-dim rule's strategies are returned before their expansion over the mesh
    (:class:`MeshExpansion`), where DTensor would expand them plainly. (DTensor's expansion
    is replaced for the call's duration, and captures only the call this one makes: on this
    thread, for this ``schema``; any other call, on another thread or for another schema,
    reaches DTensor's.)
    """
    prop = sharding_propagator()
    single = prop.op_single_dim_strategy_funcs.get(op)
    if single is not None:
        if not capture:
            fn = _expand_single_dim_strategy_to_mesh(mesh, schema, single, out_meta)
            return fn(op, schema.args_meta, schema.kwargs_meta)
        original, thread = op_utils.expand_to_full_mesh_op_strategy, threading.get_ident()

        def expansion(mesh: Any, op_schema: OpSchema, strategies: Any, **kwargs: Any) -> Any:
            if op_schema is schema and threading.get_ident() == thread:
                return _capture_expansion(original, mesh, op_schema, strategies, **kwargs)
            return original(mesh, op_schema, strategies, **kwargs)

        # (the single-dim module imports the expansion from utils when it makes ``fn``)
        op_utils.expand_to_full_mesh_op_strategy = expansion
        try:
            fn = _expand_single_dim_strategy_to_mesh(mesh, schema, single, out_meta)
            return fn(op, schema.args_meta, schema.kwargs_meta)
        finally:
            op_utils.expand_to_full_mesh_op_strategy = original
    fn = prop.op_strategy_funcs.get(op)
    if fn is None:
        return None
    return fn(schema)


@contextlib.contextmanager
def no_redistribute_costs() -> Any:
    """While enumerating strategies, skip DTensor's own redistribution pricing.

    DTensor's rules price every candidate against every input placement with its own cost model
    (``redistribute_cost``); autopar prices edges itself, so this work (most of enumeration's
    time) is wasted. Only for planning: runtime dispatch needs DTensor's costs to choose.
    """
    original = op_utils.redistribute_cost
    # the rows of zeros without a call per source strategy (DeepSeek-V3's first pipeline stage
    # on a (16, 8, 8) mesh asks for 7.7 million: 3.0 s of 16.6 in a cProfile run), in every
    # module of DTensor's rules that imported the helper by name
    rows = op_utils.generate_redistribute_costs
    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("torch.distributed.tensor.") and m is not None
               and getattr(m, "generate_redistribute_costs", None) is rows]
    try:
        op_utils.redistribute_cost = lambda *args, **kwargs: 0.0
        for m in holders:
            m.generate_redistribute_costs = _zero_costs
        yield
    finally:
        op_utils.redistribute_cost = original
        for m in holders:
            m.generate_redistribute_costs = rows


def _zero_costs(src_strategy: OpStrategy, dst_spec: DTensorSpec) -> list[float]:
    """``generate_redistribute_costs`` while :func:`no_redistribute_costs` holds: a zero per
    strategy of ``src_strategy``."""
    return [0.0] * len(src_strategy.strategies)


def redistribute_local(local: torch.Tensor, src_spec: Any, dst_spec: Any) -> torch.Tensor:
    """Redistribute a local shard between specs, including ``Replicate -> Partial``.

    Public ``DTensor.redistribute`` refuses ``Replicate -> Partial`` (needed, for example, by a
    row-parallel bias); DTensor's internal routine performs it locally, with no communication.
    """
    return redistribute_local_tensor(local, src_spec, dst_spec)


def init_fake_process_group(world_size: int) -> None:
    """Initialise the single-process "fake" backend so DeviceMeshes of any size can be built."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def resolve_process_group(name: str) -> Any:
    """The process group registered under ``name`` (a DeviceMesh group's ``group_name``, as the
    functional collectives take it)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def process_group_options(backend: str, timeout_s: float) -> Any:
    """Backend options carrying a collective timeout, for ``init_device_mesh``'s
    ``backend_override`` (the only way to give a DeviceMesh's groups a timeout: groups it
    creates otherwise take torch's default, not the default group's)."""
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        raise ValueError(f"a collective timeout is supported on the gloo and nccl backends, "
                         f"not {backend!r}; leave Mesh.timeout_s at None.")
    options._timeout = timedelta(seconds=timeout_s)
    return options


def export_joint(
    module: torch.nn.Module, args: tuple[Any, ...], stack: contextlib.ExitStack,
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """AOTAutograd joint forward+backward export with input/output descriptors."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with torch.fx.traceback.preserve_node_meta():
        return aot_export_joint_with_descriptors(stack, module, args, kwargs)



def inductor_compile(gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
    """Compile an aten-level FX graph (with functional collectives) with inductor, no dynamo.

    The lowered program is already a flat aten graph, so dynamo has nothing to do; inductor's
    entry point for FX graphs takes it as is.
    """
    import copy

    import torch._inductor

    # inductor's functionalization refuses in-place functional collectives (the gradient
    # buckets' all_reduce_); it takes the out-of-place op and makes it in place itself
    inplace = torch.ops._c10d_functional.all_reduce_.default
    if any(n.target is inplace for n in gm.graph.nodes):
        gm = copy.deepcopy(gm)
        for n in gm.graph.nodes:
            if n.target is inplace:
                n.target = torch.ops._c10d_functional.all_reduce.default
        gm.recompile()
    return torch._inductor.compile(gm, example_inputs)


def partition_joint(gm: Any, num_fwd_outputs: int) -> tuple[Any, Any]:
    """Split a joint graph (placeholders named ``primals_*``/``tangents_*``) into forward and
    backward graphs with AOTAutograd's default partitioner."""
    from torch._functorch.partitioners import default_partition

    return default_partition(gm, None, num_fwd_outputs=num_fwd_outputs)


def memory_tracker(per_module: bool = True) -> Any:
    """A new ``torch.distributed._tools.mem_tracker.MemTracker``: a dispatch mode that follows
    every tensor storage and attributes it (parameter, gradient, activation, temporary,
    optimizer state) per device, with peak snapshots. ``per_module=False``: without its
    per-module statistics, which refuse a top-level module called twice in one step (a
    pipeline stage, once per microbatch): the same totals, with no temporaries apart from the
    activations (:class:`_NoModules`)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if not per_module:
        tracker._mod_tracker = _NoModules()
    return tracker


class _NoModules:
    """Stands in for ``MemTracker``'s ``ModTracker``: no module hooks (no per-module statistics,
    and no multi-grad hooks, which fail under a zero-bubble schedule's ``autograd.grad`` on
    inputs alone); every new tensor counts as an activation, totals are unchanged."""

    parents: frozenset = frozenset({"Global"})
    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> "_NoModules":
        return self

    def __exit__(self, *args: Any) -> None:
        pass

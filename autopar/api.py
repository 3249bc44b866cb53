"""Public entry points: :func:`plan` and :func:`parallelize` (orchestration only)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.capture import capture, model_fingerprint
from autopar.config import Config
from autopar.errors import MeshError, PlanError
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.runtime.faults import check_same_plan
from autopar.runtime.module import ParallelModule
from autopar.planning.entry import plan_model

__all__ = ["plan", "parallelize", "search"]


def plan(model: nn.Module, mesh: Mesh, example_inputs: Any, *, config: Config | None = None,
         cost_passes: Sequence[Callable[..., Any]] = (),
         progress: Callable[[str], None] | None = None) -> Plan:
    """Plan ``model`` for ``mesh``: the best setup and every operator's placements.

    ``example_inputs``: a tuple of positional inputs (or a dict of keyword inputs) for one global
    training batch (real, fake or meta tensors: only their shapes and dtypes are read); the model
    must return a scalar loss. Works without devices: build the model under ``FakeTensorMode``
    and use ``Mesh.virtual(...)`` to plan for any cluster. A model built from identical blocks is
    planned by the setup search (degrees, microbatches, schedule, recomputation, ZeRO, sequence
    parallelism) and then the chosen setup's per-operator ILPs; other models by per-unit ILPs
    (:mod:`autopar.planning.entry`). ``plan.alternatives`` lists the next setups.
    """
    return plan_model(model, mesh, example_inputs, config or Config(), cost_passes, progress)


def search(model: nn.Module, mesh: Mesh, example_inputs: Any, *, config: Config | None = None,
           cost_passes: Sequence[Callable[..., Any]] = (),
           progress: Callable[[str], None] | None = None, top_k: int = 5) -> Plan:
    """:func:`plan` with ``top_k`` alternatives: the same runnable plan (kept for callers of
    the earlier cluster search, which returned a planning view that could not run)."""
    return plan_model(model, mesh, example_inputs, config or Config(), cost_passes, progress,
                      top_k=top_k)


# DeviceMeshes made for plans in this job, by (device type, shape, axis names, timeout): a job
# that parallelizes several models (or the same one again) reuses their process groups instead
# of opening new ones each time (gloo: threads and sockets per group, never closed). Each entry
# keeps the default group it was made under, so a job that re-initialises gets new ones.
_MESHES: dict[tuple, tuple[Any, Any]] = {}


def _device_mesh(p: Plan, mesh: Mesh) -> Any:
    """The plan's DeviceMesh (reused from an earlier plan of the same shape, axis names and
    timeout in this job); its process groups get ``mesh.timeout_s`` when it is set."""
    key = (mesh.device_type, tuple(p.mesh_shape), tuple(p.axis_names), mesh.timeout_s)
    world = dist.group.WORLD
    if key in _MESHES and _MESHES[key][0] is world:
        return _MESHES[key][1]
    dm = _new_device_mesh(p, mesh)
    _MESHES[key] = (world, dm)
    return dm


def _new_device_mesh(p: Plan, mesh: Mesh) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    override = None
    if mesh.timeout_s is not None:
        from autopar import _torch_private as private

        backend = dist.get_backend()
        options = private.process_group_options(backend, mesh.timeout_s)
        override = {name: (backend, options) for name in p.axis_names}
    return init_device_mesh(mesh.device_type, p.mesh_shape, mesh_dim_names=p.axis_names,
                            backend_override=override)


def parallelize(model: nn.Module, mesh: Mesh, example_inputs: Any = None, *,
                plan: Plan | str | Path | None = None, config: Config | None = None,
                cost_passes: Sequence[Callable[..., Any]] = (), compile: bool = False,
                plan_cache: bool | str | Path | None = None) -> Any:
    """Plan (or load ``plan``), lower and return a :class:`ParallelModule` for this job (a
    :class:`~autopar.runtime.pipeline.PipelineModule` when the plan is pipelined).

    Must run on every rank of the job, with the same model (same initial weights) and inputs.
    ``compile=True`` compiles the per-rank program with inductor on the first ``step`` (a
    pipeline: each stage's forward and backward graphs, on the first microbatch).
    ``plan_cache``: where plans are cached so that the next launch of the same job skips the
    search (:mod:`autopar.plan_cache`; ``False`` turns it off). The module's ``startup`` dict
    gives the seconds of each phase (capture, plan, lower, then compile after the first step)
    and whether the plan came from the cache.
    """
    from autopar.passes.lower import lower_to_local

    config = config or Config()
    startup: dict[str, Any] = {}
    t0 = time.perf_counter()
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if plan is not None and plan.solver.get("status") == "search":
        raise PlanError("this plan was saved by an earlier autopar.search as a planning view "
                        "(no per-operator placements); plan the job again with "
                        "autopar.plan(model, mesh, inputs): it now returns a runnable plan.")
    mesh.check_world()
    precision = plan.techniques.get("mixed_precision") if plan is not None else config.mixed_precision
    if plan is not None and config.mixed_precision is not None and \
            (config.mixed_precision == "bf16") != (precision == "bf16-autocast"):
        raise PlanError(f"Config(mixed_precision={config.mixed_precision!r}) disagrees with the "
                        f"plan given, made with mixed_precision={precision!r}: drop the config "
                        f"field (the plan's is used) or re-plan with it.")
    traced = capture(model, example_inputs, "bf16" if precision in ("bf16", "bf16-autocast") else None)
    t1 = time.perf_counter()
    startup["capture_s"] = t1 - t0
    if plan is None:
        the_plan, startup["plan_cache"] = _plan_once(traced, mesh, config, cost_passes, model,
                                                     example_inputs, plan_cache)
    else:
        startup["plan_cache"] = "given"
        the_plan = plan
        fingerprint = model_fingerprint(model, example_inputs)
        if the_plan.model_fingerprint != fingerprint:
            raise PlanError(
                f"the plan was made for another model or input shapes (fingerprint "
                f"{the_plan.model_fingerprint}, this model {fingerprint}); re-plan with "
                f"autopar.plan(model, mesh, example_inputs).")
    if int(torch.tensor(the_plan.mesh_shape).prod()) != mesh.size:
        raise MeshError(
            f"the plan is for a mesh {the_plan.mesh_shape} ({int(torch.tensor(the_plan.mesh_shape).prod())} "
            f"devices) but the job has {mesh.size}; re-plan for this mesh.")
    t2 = time.perf_counter()
    startup["plan_s"] = t2 - t1
    check_same_plan(the_plan)
    dm = _device_mesh(the_plan, mesh)
    if the_plan.pipeline is not None:
        pmodel = _pipelined(model, example_inputs, traced, the_plan, dm, mesh.timeout_s, compile)
    else:
        prefetch, regather = _zero_gathers(traced, the_plan)
        local = lower_to_local(traced.gm, the_plan, dm, _recomputed(traced, the_plan),
                               regather, prefetch)
        pmodel = ParallelModule(model, traced, the_plan, dm, local, compile=compile,
                                timeout_s=mesh.timeout_s)
    startup["lower_s"] = time.perf_counter() - t2
    pmodel.startup.update(startup)
    return pmodel


def _plan_once(traced: Any, mesh: Mesh, config: Config, cost_passes: Sequence, model: nn.Module,
               example_inputs: Any, setting: bool | str | Path | None) -> tuple[Plan, str]:
    """Plan on rank 0 and send the plan to every rank (in a job of more than one process).

    One planner instead of one per rank: the others do not compete with it for the CPU, and a
    solver time limit cannot end differently on different ranks. The ranks first check that
    they would plan the same problem (same model, inputs, mesh, topology, config and cost
    passes); if rank 0 fails, every rank raises its error."""
    from autopar import errors, plan_cache

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _cached_plan(traced, mesh, config, cost_passes, model, example_inputs, setting)
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, plan_cache.plan_key(traced, mesh, config, cost_passes))
    differ = [r for r, k in enumerate(keys) if k != keys[0]]
    if differ:
        raise PlanError(f"ranks {differ} would plan another problem than rank 0 (model, inputs, "
                        f"mesh, topology, Config or cost passes differ). Give every rank the same "
                        f"ones, or load one saved plan everywhere with parallelize(..., plan=...).")
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            fresh, how = _cached_plan(traced, mesh, config, cost_passes, model, example_inputs, setting)
            box = [(fresh.to_json(), how)]
        except Exception as e:
            box = [(None, (type(e).__name__, str(e)))]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    text, how = box[0]
    if text is None:
        name, message = how
        kind = getattr(errors, name, None)
        kind = kind if isinstance(kind, type) and issubclass(kind, errors.AutoparError) else PlanError
        raise kind(f"rank 0 could not plan ({name}): {message}")
    return Plan.from_dict(json.loads(text)), how


def _cached_plan(traced: Any, mesh: Mesh, config: Config, cost_passes: Sequence, model: nn.Module,
                 example_inputs: Any, setting: bool | str | Path | None) -> tuple[Plan, str]:
    """The plan from the cache (``"hit"``), or planned and stored (``"miss"``; ``"off"``
    without a cache)."""
    from autopar import plan_cache

    directory = plan_cache.cache_dir(setting)
    key = plan_cache.plan_key(traced, mesh, config, cost_passes) if directory else ""
    cached = plan_cache.load_cached(directory, key) if directory else None
    if cached is not None:
        return cached, "hit"
    fresh = plan_model(model, mesh, example_inputs, config, cost_passes, traced=traced)
    if directory:
        plan_cache.store_cached(directory, key, fresh)
    return fresh, "miss" if directory else "off"


def _recomputed(traced: Any, the_plan: Plan) -> frozenset[str]:
    from autopar.capture.remat import recompute_nodes

    return recompute_nodes(traced, the_plan.techniques.get("recompute", "none"))


def _zero_gathers(traced: Any, the_plan: Plan) -> tuple[frozenset[str], frozenset[str]]:
    """The chains a ZeRO plan without a pipeline prefetches, and gathers again for the
    backward (``capture.remat.zero_gathers``)."""
    from autopar.capture.remat import zero_gathers

    return zero_gathers(traced, the_plan.techniques.get("zero", 0))


def _pipelined(model: nn.Module, example_inputs: Any, traced: Any, the_plan: Plan, dm: Any,
               timeout_s: float | None, compile: bool) -> Any:
    """Trace the plan's stages, lower this rank's, and build the pipelined module."""
    from autopar.passes.lower import lower_to_local
    from autopar.runtime.pipeline import PipelineModule
    from autopar.planning.pipeline import forward_for_plan

    pipe = the_plan.pipeline
    fwd, stages = forward_for_plan(model, example_inputs, the_plan)
    submesh = dm[tuple(the_plan.axis_names[1:])]
    pp, rank = the_plan.degrees["pp"], dm.get_local_rank("pp")
    built = []
    for st, stage_traced in stages:
        stage_plan = pipe.stages[st.index]
        local = (lower_to_local(stage_traced.gm, stage_plan, submesh, _recomputed(stage_traced, stage_plan))
                 if st.index % pp == rank else None)
        built.append((st, stage_traced, local))
    return PipelineModule(model, the_plan, dm, built, fwd.canonical, traced.input_spec, timeout_s,
                          compile)

"""Job-level failures: ranks that planned differently, and a dead or hung rank.

:func:`check_same_plan` runs before the first step: every rank must execute the same plan, or
the first collective would pair tensors of different shapes (or wait forever). The ranks
compare an 8-byte hash; when they differ, they exchange summaries and the error names what
differs (degrees, techniques, model fingerprint, versions, placements).

:func:`collective_failures` turns a failed collective into a :class:`~autopar.RankFailureError`.

A rank that dies closes its connections: its peers' next collective with it fails at once. A
rank that hangs answers nothing: its peers wait in the collective until the process group's
timeout (``Mesh.timeout_s``), then fail. Ranks that share no collective with the failed rank
in this step fail at their next collective that depends on it (a rank waiting on a rank that
failed fails in turn, so the failure spreads through the job within about one timeout).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, PlanError, RankFailureError
from autopar.plan import Plan

__all__ = ["collective_failures", "check_same_plan", "plan_summary", "plan_difference"]

# what gloo and NCCL put in the RuntimeErrors they raise for a lost or silent peer
_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
            "broken pipe")


def _collective_failure(error: BaseException) -> BaseException | None:
    """The backend error in ``error``'s chain of causes (torch's pipelining wraps it in a
    RuntimeError of its own), or ``None`` when the error is not a failed collective."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, AutoparError):
            return None
        if isinstance(current, dist.DistError) or (
                isinstance(current, RuntimeError)
                and any(m in str(current).lower() for m in _MARKERS)):
            return current
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def collective_failures(what: str, timeout_s: float | None) -> Iterator[None]:
    """Re-raise a failed collective inside the block as :class:`RankFailureError` (the
    original error chained as its cause); other errors pass unchanged."""
    try:
        yield
    except Exception as error:
        cause = _collective_failure(error)
        if cause is None:
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        waited = ("the mesh's timeout_s" if timeout_s is None else f"timeout_s={timeout_s:g}")
        text = str(cause).strip()
        first = text.splitlines()[0][:300] if text else type(cause).__name__
        raise RankFailureError(
            f"rank {rank} of {world}: a collective in {what} failed, so another rank of the job "
            f"died or stopped answering (waited up to {waited}). The backend said: {first}. "
            f"Find the failed rank in its own log; restart from the last checkpoint "
            f"(autopar.load_checkpoint). Set the wait with Mesh.from_torchrun(timeout_s=...)."
        ) from error


def plan_summary(plan: Plan) -> dict[str, Any]:
    """What a rank's plan is made of, to name the difference between two ranks' plans."""
    from autopar import __version__

    pipe = plan.pipeline
    return {
        "autopar version": __version__, "torch version": torch.__version__,
        "model fingerprint": plan.model_fingerprint, "input shapes": list(plan.input_shapes),
        "mesh": dict(zip(plan.axis_names, plan.mesh_shape)), "degrees": plan.degrees,
        "techniques": plan.techniques, "topology": plan.topology, "config": plan.config,
        "pipeline": None if pipe is None else [pipe.schedule, pipe.microbatches,
                                               pipe.virtual_stages, list(pipe.stage_of_unit)],
        "parameter placements": {k: tuple(v) for k, v in plan.params.items()},
        "node placements": {k: (v.outputs, v.inputs) for k, v in plan.nodes.items()},
        "collectives": len(plan.collectives),
    }


def plan_difference(a: dict[str, Any], b: dict[str, Any], limit: int = 3) -> list[str]:
    """The fields of two :func:`plan_summary` dicts that differ, most telling first; for
    placements, the first ``limit`` names that differ."""
    out = []
    for key in a:
        if a[key] == b.get(key):
            continue
        if isinstance(a[key], dict) and key.endswith("placements"):
            names = [n for n in a[key] if a[key][n] != b[key].get(n)] + \
                [n for n in b[key] if n not in a[key]]
            shown = ", ".join(f"{n}: {a[key].get(n)} vs {b[key].get(n)}" for n in names[:limit])
            out.append(f"{key} of {len(names)} names ({shown}{', ...' if len(names) > limit else ''})")
        elif isinstance(a[key], dict) and isinstance(b.get(key), dict):
            fields = [f for f in dict.fromkeys([*a[key], *b[key]]) if a[key].get(f) != b[key].get(f)]
            out.append(f"{key}: " + ", ".join(f"{f}={a[key].get(f)} vs {b[key].get(f)}" for f in fields))
        else:
            out.append(f"{key}: {a[key]} vs {b.get(key)}")
    return out


def check_same_plan(plan: Plan) -> None:
    """Raise :class:`PlanError` on every rank unless all ranks hold the same plan (see the
    module docstring); the message names the ranks and what differs from rank 0's plan."""
    digest = bytes.fromhex(plan.digest())[:8]
    # NCCL moves CUDA tensors only; gloo, CPU ones
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor(list(digest), dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if not bad:
        return
    summaries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, plan_summary(plan))
    diff = plan_difference(summaries[0], summaries[bad[0]])
    raise PlanError(
        f"ranks {bad} computed a different plan than rank 0; rank 0 vs rank {bad[0]}: "
        f"{'; '.join(diff) or 'collective order only'}. Different models, inputs, configs or "
        f"versions across ranks cause this. Make every rank build the same model and inputs, or "
        f"load one saved plan everywhere with parallelize(..., plan='plan.json').")

"""Plans cached on disk: a second launch of the same job skips the search.

The key is a hash of everything a plan depends on: the traced model (its graph fingerprint,
parameter and input dtypes), the mesh (nodes, devices per node, the topology's numbers), the
config, the cost passes (registered and given), and the code that plans (autopar's version
and a digest of its source files, torch's version), so a changed model, mesh, setting or
library never reads a stale plan. Each rank reads the file itself; ``parallelize`` still checks
that all ranks hold the same plan.

Where: ``$AUTOPAR_CACHE_DIR/plans`` if set, else ``$XDG_CACHE_HOME/autopar/plans`` (or
``~/.cache/autopar/plans``). ``parallelize(..., plan_cache=False)`` or ``AUTOPAR_PLAN_CACHE=0``
turns it off; ``plan_cache="dir"`` uses another directory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from autopar.config import Config
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.mesh import Mesh
from autopar.plan import Plan

__all__ = ["cache_dir", "plan_key", "load_cached", "store_cached"]


def cache_dir(setting: bool | str | Path | None = None) -> Path | None:
    """The plan cache directory for ``parallelize``'s ``plan_cache`` argument: ``None`` or
    ``True`` the default (module docstring), ``False`` none, a path that directory."""
    if setting is False:
        return None
    if setting not in (None, True):
        return Path(setting)
    if os.environ.get("AUTOPAR_PLAN_CACHE", "1") == "0":
        return None
    if "AUTOPAR_CACHE_DIR" in os.environ:
        return Path(os.environ["AUTOPAR_CACHE_DIR"]) / "plans"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar" / "plans"


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """A hash of the source of every module of autopar (the planner's behaviour)."""
    import autopar
    import autopar.cost_models
    import autopar.passes

    h = hashlib.sha256()
    for package in (autopar, autopar.passes, autopar.cost_models):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _pass_id(fn: Callable[..., Any]) -> str:
    code = getattr(fn, "__code__", None)
    body = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:12] \
        if code is not None else repr(fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}:{body}"


def plan_key(traced: TracedGraph, mesh: Mesh, config: Config,
             cost_passes: Sequence[Callable[..., Any]] = ()) -> str:
    """The cache key of the plan of ``traced`` on ``mesh`` under ``config`` (module docstring)."""
    from autopar import __version__
    from autopar.cost_models.passes import registered_cost_passes

    topology = mesh.topology
    key = {
        "model": traced.fingerprint(),
        "dtypes": [str(p.dtype) for p in traced.params] + [str(i.dtype) for i in traced.inputs],
        "inputs": [list(i.shape) for i in traced.inputs],
        "mesh": [mesh.nodes, mesh.devices_per_node, mesh.device_type],
        "topology": dataclasses.asdict(topology) if dataclasses.is_dataclass(topology) else repr(topology),
        "config": config.to_dict(),
        "cost_passes": [_pass_id(f) for f in (*registered_cost_passes(), *cost_passes)],
        "code": [__version__, _source_digest(), torch.__version__],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load_cached(directory: Path, key: str) -> Plan | None:
    """The cached plan under ``key``, or ``None``. An unreadable entry is a miss (with a
    warning): the job plans again and overwrites it."""
    path = directory / f"{key}.json"
    if not path.exists():
        return None
    try:
        return Plan.load(path)
    except PlanError as e:
        warnings.warn(f"ignoring the cached plan {path} ({e}); planning again.", stacklevel=3)
        return None


def store_cached(directory: Path, key: str, plan: Plan) -> None:
    """Write ``plan`` under ``key`` (atomically: ranks writing the same entry do not clash).
    A directory that cannot be written only warns: caching is an optimisation."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(plan.to_json())
        os.replace(tmp, directory / f"{key}.json")
    except OSError as e:
        warnings.warn(f"could not write the plan cache in {directory} ({e}); the next launch "
                      f"plans again.", stacklevel=3)

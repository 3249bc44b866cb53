"""Checkpoint checks run inside a torchrun job of ``worker.py``.

``ckpt:MODEL|PLAN_A|PLAN_B|...`` (``MODEL`` as a worker check without degrees, e.g.
``gpt,layers=2,batch=8,topo=slow-compute``; each ``PLAN`` the Config keys, e.g.
``pp=2,microbatch_size=2``):

1. under plan A, ``state_dict()`` equals the single-device model's (keys, order and values);
2. plan A trains 2 AdamW steps, saves a sharded checkpoint (model and optimizer) and trains 2
   more steps (the uninterrupted run);
3. each other plan builds the model with other weights, loads the checkpoint and trains 2
   steps: its parameters and optimizer state right after loading, and its 2 losses, are
   compared with plan A's; then it loads plan A's full state dict with ``load_state_dict``.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import autopar
from models import build

STEPS = 2
_FULL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)


def _parse(spec: str) -> tuple[str, dict, str, list[dict]]:
    model, *plans = spec.split("|")
    kind, _, rest = model.partition(",")
    mk = dict(item.split("=") for item in filter(None, rest.split(",")))
    topo = mk.pop("topo", "cpu-gloo")
    mk = {k: int(v) for k, v in mk.items()}
    configs = []
    for plan in plans:
        cfg: dict = {}
        for item in filter(None, plan.split(",")):
            k, v = item.split("=")
            cfg[k] = v if k in ("schedule", "recompute") else int(v)
        configs.append(cfg)
    return kind, mk, topo, configs


def _train(pm, opt, inputs, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = pm.step(**inputs) if isinstance(inputs, dict) else pm.step(*inputs)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _max_err(a: dict, b: dict, keys) -> float:
    errs = [(a[k].float() - b[k].float()).abs().max().item() if a[k].numel() else 0.0 for k in keys]
    t = torch.tensor([max(errs, default=0.0)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _optimizer_full(pm, opt) -> dict[str, torch.Tensor]:
    state = get_optimizer_state_dict(pm, opt, options=_FULL)
    # copies (a replicated state's full tensor is the optimizer's own tensor), merged over ranks
    # (a pipeline rank holds only its stages' parameters)
    mine = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def run_checkpoint(spec: str, workdir: str) -> dict:
    """See the module docstring; returns the errors and losses for the test to assert on."""
    from worker import topology  # (worker imports this module)

    kind, mk, topo, (plan_a, *others) = _parse(spec)
    mesh = autopar.Mesh.from_torchrun(topology=topology(topo))
    model, inputs = build(kind, **dict(mk))
    ref, _ = build(kind, **dict(mk))
    pa = autopar.parallelize(model, mesh, inputs, config=autopar.Config(**plan_a))
    full, ref_state = pa.state_dict(), ref.state_dict()
    record = {"placements": sorted({p for ps in pa.plan.params.values() for p in ps}),
              "keys_match": list(full) == list(ref_state),
              "full_vs_single_err": _max_err(full, ref_state, ref_state), "plans": {}}
    opt = torch.optim.AdamW(pa.parameters(), lr=1e-2)
    record["losses_before"] = _train(pa, opt, inputs, STEPS)
    path = os.path.join(workdir, f"ckpt-{zlib.crc32(spec.encode()):08x}")  # same on every rank
    autopar.save_checkpoint(path, pa, opt, extra={"step": STEPS})
    saved, saved_opt = pa.state_dict(), _optimizer_full(pa, opt)
    record["losses_after"] = _train(pa, opt, inputs, STEPS)
    for plan_b in others:
        other, _ = build(kind, seed=7, **dict(mk))  # other weights: the load must set them all
        pb = autopar.parallelize(other, mesh, inputs, config=autopar.Config(**plan_b))
        opt_b = torch.optim.AdamW(pb.parameters(), lr=1e-2)
        extra = autopar.load_checkpoint(path, pb, opt_b)
        loaded_opt = _optimizer_full(pb, opt_b)
        loaded = pb.state_dict()
        r = {"extra": extra, "degrees": pb.plan.degrees,
             "state_err": _max_err(loaded, saved, saved),
             "opt_keys_match": sorted(loaded_opt) == sorted(saved_opt) and len(saved_opt) > 0,
             "opt_err": _max_err(loaded_opt, saved_opt, loaded_opt)}
        r["losses"] = _train(pb, opt_b, inputs, STEPS)
        pb.load_state_dict(saved)  # the full state dict of plan A, loaded under plan B
        r["full_load_err"] = _max_err(pb.state_dict(), saved, saved)
        record["plans"]["|".join(f"{k}={v}" for k, v in plan_b.items())] = r
    record["errors"] = _errors(kind, mk, plan_a, pa, saved, path, os.path.join(workdir, "no-optim"),
                               mesh)
    return record


def _errors(kind: str, mk: dict, plan_a: dict, pa, saved: dict, path: str, bare: str,
            mesh: autopar.Mesh) -> dict:
    """What bad checkpoint input gets: each entry the error's type and message."""
    def attempt(fn) -> str:
        try:
            fn()
            return "no error"
        except Exception as e:  # the test asserts on the type and message
            return f"{type(e).__name__}: {e}"

    autopar.save_checkpoint(bare, pa)  # no optimizer state
    other, inputs = build(kind, **{**mk, "layers": mk.get("layers", 2) + 1})
    bigger = autopar.parallelize(other, mesh, inputs,
                                 config=autopar.Config(**plan_a))
    key = next(iter(saved))
    return {
        "no_optimizer_state": attempt(lambda: autopar.load_checkpoint(
            bare, pa, torch.optim.AdamW(pa.parameters()))),
        "other_model": attempt(lambda: autopar.load_checkpoint(path, bigger)),
        "unexpected_key": attempt(lambda: pa.load_state_dict({**saved, "extra.weight": saved[key]})),
        "missing_key": attempt(lambda: pa.load_state_dict({k: v for k, v in saved.items() if k != key})),
        "non_strict": str(pa.load_state_dict({**saved, "extra.weight": saved[key]}, strict=False)),
        "wrong_shape": attempt(lambda: pa.load_state_dict({**saved, key: saved[key][:1]})),
        "dtensor": attempt(lambda: pa.load_state_dict(pa.sharded_state_dict())),
    }

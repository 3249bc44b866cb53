"""autopar's expert parallelism against a hand-written expert-parallel version of the same MoE model.

    python benchmarks/moe_ep.py [--procs 2 4] [--size default] [--repeats 10] [--warmup 2] [--json out.json]

starts one ``torchrun`` job per process count n (CPU processes, gloo) and, on a Mixtral-style
model built from a ``transformers.MixtralConfig`` (never downloaded; default size: hidden 256,
8 experts of ffn 512, top-2, 2 layers, 2048 tokens per rank; ``--size tiny`` for the tests)
and one batch of n x the per-rank batch, compares

- autopar ``Config(dp=n, ep=n, tp=1, pp=1, zero=0)``: the batch split over the n ranks, each MoE layer's
  experts computed split over them (E/n each), each layer's experts one op
  (``autopar.capture.moe``) that exchanges the per-expert counts and sends the (token, choice)
  rows to their experts' ranks and back by all-to-all, in the forward and again in the backward
  (which recomputes the experts); the rest of the step (where the parameters are stored, how the
  gradients are reduced) is whatever its plan chose, printed with the table;
- the same model parallelised by hand with plain ``torch.distributed``: each rank holds E/n
  experts of each layer (a module put in place of transformers' experts module, so the
  router and its top-k are the model's own), sorts its (token, choice) pairs by destination
  rank, exchanges the per-expert counts (``all_to_all_single``), sends the rows (dropless, split
  sizes from the counts), runs its experts, sends the results back and weights and sums them;
  the backward by autograd (an ``autograd.Function`` around ``all_to_all_single``: the two row
  all-to-alls again, reversed; the experts' activations are kept, not recomputed), then one
  all-reduce of every dense gradient (router, attention, norms, embeddings, LM head) and the
  loss, flattened into one buffer, after the backward.

A step is the forward and backward of the global batch with the gradients synchronised (what
``pmodel.step`` does; no optimizer); each rank runs its 1/n of the batch on both sides. The
timing, interleaving and counting are ``runtime_vs_torch.py``'s (:func:`runtime_vs_torch.measure`):
medians of interleaved steps between barriers, collectives counted on every rank with
:class:`autopar.runtime.profile.CommMeter`; autopar's are set against its plan's
(``plan.collective_bytes()``, which assumes every rank receives as many rows as it sends). The
hand-written version is checked against one process (loss and every gradient on the global
batch); the routing skew is the busiest rank's received rows over the mean, per MoE layer and
summed over the layers (the routing is the same on both sides: same weights, same batch).
Eager only (``--no-compile``, which the shared launcher knows, changes nothing). CPU timings
are noisy (and 4 processes share 2 cores on a 2-core machine): compare the ratios of one run,
not figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime_vs_torch import job_main, measure, per_rank  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# hidden, ffn of one expert, experts, top-k, layers, heads, sequence, batch per rank, vocabulary
SIZES = {
    "default": dict(dim=256, ffn=512, experts=8, top_k=2, layers=2, heads=4, seq=256, batch=8,
                    vocab=1024),
    "tiny": dict(dim=32, ffn=64, experts=4, top_k=2, layers=2, heads=2, seq=16, batch=2, vocab=64),
}


def make_model(size: dict) -> nn.Module:
    """The Mixtral-style causal LM of ``size``, the same weights on every rank and side."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=size["vocab"], hidden_size=size["dim"],
                        intermediate_size=size["ffn"], num_hidden_layers=size["layers"],
                        num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
                        max_position_embeddings=size["seq"], num_local_experts=size["experts"],
                        num_experts_per_tok=size["top_k"], pad_token_id=0, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return model


def make_batch(size: dict, procs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (``procs`` x the per-rank batch): input ids and labels (the same ids;
    the model shifts them)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (procs * size["batch"], size["seq"]), generator=g)
    return ids, ids.clone()


# ---- hand-written expert parallelism ---------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows, ``send[j]`` to rank j and ``recv[j]`` from it; its
    backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.send, ctx.recv = send, recv
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv)
        return out, None, None


class HandExperts(nn.Module):
    """Put in place of a transformers experts module (called with the tokens, their top-k
    expert ids and weights): this rank's E/n experts (rank r holds experts rL .. rL + L - 1)
    and the dispatch to them. ``received`` is the rows the last forward received."""

    def __init__(self, experts: nn.Module, rank: int, world: int) -> None:
        super().__init__()
        self.num_experts, self.world = experts.num_experts, world
        self.local = local = experts.num_experts // world
        mine = slice(rank * local, (rank + 1) * local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[mine].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[mine].clone())
        self.act_fn = experts.act_fn
        self.received = 0

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        n, local = self.world, self.local
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, so by destination rank
        token = order // index.shape[1]
        counts = torch.bincount(flat, minlength=self.num_experts)
        got = torch.empty_like(counts)  # [source rank, local expert] rows coming here
        dist.all_to_all_single(got, counts)
        send = counts.view(n, local).sum(1).tolist()
        recv = got.view(n, local).sum(1).tolist()
        self.received = sum(recv)
        rows = _AllToAll.apply(hidden[token], send, recv)  # by source rank, then local expert
        expert = torch.repeat_interleave(torch.arange(local).repeat(n), got)
        perm = torch.argsort(expert, stable=True)  # regrouped by local expert
        outs = []
        for e, x in enumerate(rows[perm].split(got.view(n, local).sum(0).tolist())):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        back = _AllToAll.apply(torch.cat(outs)[torch.argsort(perm)], recv, send)
        mixed = back * weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, mixed.to(hidden.dtype))


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks (router ``gate`` and ``experts``), in order."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


def hand_variant(size: dict) -> tuple[Any, list[nn.Parameter], nn.Module]:
    """The hand-written expert-parallel step, its parameters and the model."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    model = make_model(size)
    rank, world = dist.get_rank(), dist.get_world_size()
    for block in moe_blocks(model):
        block.experts = HandExperts(block.experts, rank, world)
    expert_params = {id(p) for m in model.modules() if isinstance(m, HandExperts)
                     for p in m.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_params]
    b = size["batch"]

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mine = slice(rank * b, (rank + 1) * b)
        loss = model(input_ids=ids[mine], labels=labels[mine]).loss / world
        loss.backward()  # (the experts' gradients: every rank's tokens, each loss over n)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
        flat = _flatten_dense_tensors(grads + [loss.detach().view(1)])
        dist.all_reduce(flat)  # the dense gradients and the loss, one buffer
        for p, g in zip(dense, _unflatten_dense_tensors(flat, grads + [loss.detach().view(1)])):
            p.grad = g
        return flat[-1]

    return step, list(model.parameters()), model


# ---- checks ----------------------------------------------------------------------------------

def one_process(size: dict, batch: tuple) -> tuple[nn.Module, float, list[torch.Tensor]]:
    """The model on the whole batch in this process: the model with its gradients, its loss,
    and each MoE layer's top-k expert ids."""
    ref = make_model(size)
    routes: list[torch.Tensor] = []
    for block in moe_blocks(ref):
        block.gate.register_forward_hook(lambda m, a, out: routes.append(out[2].detach()))
    loss = ref(input_ids=batch[0], labels=batch[1]).loss
    loss.backward()
    return ref, loss.item(), routes


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_hand(step: Any, model: nn.Module, batch: tuple, ref: nn.Module,
               ref_loss: float) -> dict:
    """The hand-written step against one process: loss, the worst gradient's relative error
    (norm of the difference over the norm; this rank's experts against their rows of the
    whole ones) over the ranks, and the rows each rank received per layer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for p in model.parameters():
        p.grad = None
    loss = step(*batch).item()
    whole = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        g = whole[name].grad
        if p.shape != g.shape:  # an expert weight: this rank's rows
            local = p.shape[0]
            g = g[rank * local:(rank + 1) * local]
        worst = max(worst, _rel(p.grad, g))
    w = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    received = torch.tensor([m.received for m in model.modules() if isinstance(m, HandExperts)])
    every = [torch.empty_like(received) for _ in range(world)]
    dist.all_gather(every, received)
    for p in model.parameters():
        p.grad = None
    return {"hand_loss": loss, "hand_loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
            "hand_grad_rel_err": w.item(),
            # rows received per MoE layer, per rank
            "received": torch.stack(every, 1).tolist()}


def skew(received: list[list[int]]) -> tuple[list[float], float]:
    """The busiest rank's received rows over the mean, per layer and summed over the layers."""
    per_layer = [max(r) / (sum(r) / len(r)) for r in received]
    total = [sum(col) for col in zip(*received)]
    return per_layer, max(total) / (sum(total) / len(total))


def received_per_rank(routes: list[torch.Tensor], experts: int, world: int) -> list[list[int]]:
    """Per layer and rank, the rows one process's routing of the whole batch sends to the
    rank's experts (what each rank should receive)."""
    local = experts // world
    return [torch.bincount(r.reshape(-1) // local, minlength=world).tolist() for r in routes]


# ---- the comparison --------------------------------------------------------------------------

def compare(size: dict, repeats: int, warmup: int) -> dict:
    """autopar's ep=n plan and the hand-written one on this job: times, collectives, checks."""
    n = dist.get_world_size()
    batch = make_batch(size, n)
    ref, ref_loss, routes = one_process(size, batch)
    mesh = autopar.Mesh.from_torchrun(topology="cpu-gloo")
    # zero=0: no ZeRO, as the hand-written side (and what the search picks on 2 ranks anyway)
    config = autopar.Config(dp=n, ep=n, tp=1, pp=1, zero=0)
    pm = autopar.parallelize(make_model(size), mesh, {"input_ids": batch[0], "labels": batch[1]},
                             config=config, plan_cache=False)
    if pm.plan.degrees.get("ep") != n:
        raise RuntimeError(f"autopar planned {pm.plan.degrees}, not ep={n}")
    autopar_loss = pm.step(input_ids=batch[0], labels=batch[1]).item()
    for p in pm.parameters():
        p.grad = None
    hand_step, hand_params, hand_model = hand_variant(size)
    checks = check_hand(hand_step, hand_model, batch, ref, ref_loss)

    def autopar_step(ids: torch.Tensor, labels: torch.Tensor) -> Any:
        return pm.step(input_ids=ids, labels=labels)

    variants = {"autopar": (autopar_step, list(pm.parameters())), "hand": (hand_step, hand_params)}
    res = measure(variants, batch, repeats, warmup)
    plan = pm.plan
    predicted = {"counts": dict(plan.collective_counts()), "bytes": dict(plan.collective_bytes())}
    ranks = per_rank({k: {"counts": v["counts"], "bytes": v["bytes"]} for k, v in res.items()}
                      | {"plan": predicted})
    per_layer, overall = skew(checks["received"])
    held = {"autopar": _expert_elements(pm.named_parameters()),
            "hand": _expert_elements(hand_model.named_parameters())}
    return {"comparison": f"ep={n}", "procs": n, "degrees": plan.degrees,
            "autopar_s": res["autopar"]["median_s"], "hand_s": res["hand"]["median_s"],
            "ratio": res["autopar"]["median_s"] / res["hand"]["median_s"],
            "predicted_s": plan.predicted["step_time_s"], "ref_loss": ref_loss,
            "autopar_loss": autopar_loss,
            "autopar_loss_rel_err": abs(autopar_loss - ref_loss) / abs(ref_loss),
            **checks, "routing_as_one_process":
                checks["received"] == received_per_rank(routes, size["experts"], n),
            "skew_per_layer": per_layer, "skew": overall, "expert_elements_held": held,
            "ranks": ranks,
            "times": {k: v["times"] for k, v in res.items()}}


def _expert_elements(named: Any) -> int:
    """The expert weights' elements this rank holds between steps."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for name, p in named if ".experts." in name)


def _mean_bytes(ranks: list[dict], who: str, kinds: Any) -> str:
    """Mean over the ranks of ``who``'s bytes of ``kinds`` (a kind or a predicate), in MiB or
    KiB."""
    pick = kinds if callable(kinds) else (lambda k: k == kinds)
    per = [sum(v for k, v in r[who]["bytes"].items() if pick(k)) for r in ranks]
    mean = sum(per) / len(per)
    return f"{mean / 2**20:.2f} MiB" if mean >= 2**20 else f"{mean / 2**10:.1f} KiB"


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    def other(k: str) -> bool:
        return k != "all_to_all"

    rows = []
    for r in results:
        a2a = lambda who: r["ranks"][0][who]["counts"].get("all_to_all", 0)  # noqa: E731
        rows.append([r["procs"], f"{r['autopar_s'] * 1e3:.1f}", f"{r['hand_s'] * 1e3:.1f}",
                     f"{r['ratio']:.2f}", f"{_mean_bytes(r['ranks'], 'autopar', 'all_to_all')} ({a2a('autopar')})",
                     f"{_mean_bytes(r['ranks'], 'hand', 'all_to_all')} ({a2a('hand')})",
                     f"{_mean_bytes(r['ranks'], 'plan', 'all_to_all')} ({a2a('plan')})",
                     _mean_bytes(r["ranks"], "autopar", other), _mean_bytes(r["ranks"], "hand", other),
                     f"{r['skew']:.3f}", f"{r['hand_loss_rel_err']:.1e}"])
    return tabulate(rows, headers=[
        "procs", "autopar ms", "hand ms", "ratio", "autopar a2a/rank (n)", "hand a2a/rank (n)",
        "plan a2a/rank (n)", "autopar other/rank", "hand other/rank", "skew", "hand loss err"])


def worker(args: argparse.Namespace) -> None:
    """Body of each rank."""
    size = SIZES[args.size]
    results = [compare(size, args.repeats, args.warmup)]
    if dist.get_rank() == 0:
        r = results[0]
        print(f"Mixtral-style {size}, {r['procs']} processes (gloo), eager, median of "
              f"{args.repeats} interleaved steps after {args.warmup} warm-up steps")
        print(table(results))
        print(f"degrees {r['degrees']}, plan's step {r['predicted_s'] * 1e3:.1f} ms; expert "
              f"weight elements held per rank: {r['expert_elements_held']}")
        print(f"skew per layer "
              f"{', '.join(f'{s:.3f}' for s in r['skew_per_layer'])}; rows received per layer "
              f"and rank {r['received']} (as one process routes them: "
              f"{r['routing_as_one_process']})")
        print(f"one process: loss {r['ref_loss']:.6f}; hand-written {r['hand_loss']:.6f} "
              f"(relative error {r['hand_loss_rel_err']:.1e}, worst gradient "
              f"{r['hand_grad_rel_err']:.1e}); autopar {r['autopar_loss']:.6f} "
              f"({r['autopar_loss_rel_err']:.1e})")
        print("plan's collectives per rank:", r["ranks"][0]["plan"]["counts"],
              r["ranks"][0]["plan"]["bytes"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": size, "processes": r["procs"], "results": results}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Start one job per process count (or, inside one, run this rank)."""
    return job_main(__file__, __doc__, SIZES, worker, argv, repeats=10, warmup=2)


if __name__ == "__main__":
    raise SystemExit(main())

"""Train a Hugging Face GPT-2 or Llama (built from a config: nothing is downloaded) with the
plan autopar chooses.

    torchrun --standalone --nproc_per_node=4 examples/train_hf.py --model gpt2
    torchrun --standalone --nproc_per_node=4 examples/train_hf.py --model llama --layers 4
    torchrun --standalone --nproc_per_node=8 examples/train_hf.py --model llama --device cuda

On CPU (the default) the ranks talk over gloo; ``--device cuda`` uses one GPU per rank and
NCCL. The model is unmodified: given ``labels`` a Hugging Face causal LM returns an output whose
``.loss`` autopar trains. Rank 0 prints the plan, then the loss of every step; every rank passes
the same global batch and keeps the shard its plan says. ``--checkpoint DIR`` saves a sharded
checkpoint (model and optimizer) at the end and resumes from it on the next run, under whatever
plan that run chooses; ``--timeout S`` bounds how long ranks wait for a dead or hung rank.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

import autopar


def build_model(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> Any:
    """A randomly initialised GPT-2 or Llama causal LM of the given sizes (dropout off, so that
    every rank computes the same function)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                         n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=heads, max_position_embeddings=seq)
        model = LlamaForCausalLM(cfg)
    else:
        raise SystemExit(f"--model {name!r}: choose gpt2 or llama")
    model.loss_type = "ForCausalLM"
    return model


def train(pmodel: Any, batch: Callable[[int], tuple[tuple, dict]], steps: int,
          lr: float, checkpoint: str | None = None) -> list[float]:
    """Print the plan on rank 0, then run AdamW steps up to ``steps`` on ``batch(step)``
    (positional and keyword inputs); returns the loss of every step run. With ``checkpoint``
    (a directory), resume from it when it holds one (under any plan) and save there at the end."""
    rank0 = dist.get_rank() == 0
    if rank0:
        print(pmodel.plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=lr)
    start = 0
    if checkpoint is not None and os.path.exists(os.path.join(checkpoint, ".metadata")):
        start = autopar.load_checkpoint(checkpoint, pmodel, opt)["step"]
        if rank0:
            print(f"resumed from {checkpoint} at step {start}", flush=True)
    losses = []
    for step in range(start, steps):
        args, kwargs = batch(step)
        opt.zero_grad()
        loss = pmodel.step(*args, **kwargs)
        opt.step()
        losses.append(float(loss))
        if rank0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    if checkpoint is not None:
        autopar.save_checkpoint(checkpoint, pmodel, opt, extra={"step": max(start, steps)})
    return losses


def _init(device: str) -> None:
    """Start the process group for ``device`` (``Mesh.from_torchrun`` then uses it)."""
    if dist.is_initialized():
        return
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU is visible to this process")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    add_job_flags(p)
    return p


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The flags both training examples share: checkpoint directory and collective timeout."""
    p.add_argument("--checkpoint", default=None,
                   help="directory: resume from it if it holds a checkpoint, save to it at the end")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a rank waits for a dead or hung rank (default: torch's)")


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Plan, parallelize and train; returns the loss of every step (on every rank)."""
    args = _parser().parse_args(argv)
    created = not dist.is_initialized()
    _init(args.device)
    try:
        mesh = autopar.Mesh.from_torchrun(timeout_s=args.timeout)
        torch.manual_seed(0)  # every rank builds the same initial weights
        model = build_model(args.model, args.layers, args.hidden, args.heads, args.vocab, args.seq)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        pmodel = autopar.parallelize(model, mesh, {"input_ids": ids, "labels": ids})
        # one batch, over and over: the loss must fall (a real job reads new data here)
        return train(pmodel, lambda step: ((), {"input_ids": ids, "labels": ids}), args.steps,
                     args.lr, args.checkpoint)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

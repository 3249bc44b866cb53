"""The planner's own setup space at test size, as worker checks (``worker.py``).

The setups come from :func:`autopar.planning.setups.candidate_setups`, the enumeration the setup
search prices (not a copy of it): every (dp, tp, pp), microbatch size, schedule, virtual stages,
recomputation, ZeRO and sequence parallelism it allows for the test GPT on 2 or 4 devices. The
per-unit planner also emits the GPipe and zero-bubble schedules (when a Config asks for them):
each 1F1B setup is added as GPipe too, each interleaved one as zero-bubble (the same stages). A setup's *kind* is what changes the program (the
schedule, v > 1, tp > 1, dp > 1, sequence parallelism, ZeRO and hybrid sharding, recomputation,
precision); sizes
within a kind do not.
"""

from __future__ import annotations

import dataclasses

from autopar import Config
from autopar.planning.setups import candidate_setups

__all__ = ["LLAMA", "MODEL", "Kind", "as_check", "kind_of", "one_per_kind", "space"]

# 4 blocks (2 per stage at pp=2, v=2), a batch of 8 (microbatches of 1, 2 or 4 per replica)
MODEL = "gpt:dim=32,heads=4,layers=4,batch=8,seq=8"
# Hugging Face Llama of the same size (RoPE, RMSNorm written out, SwiGLU, untied head); its
# RMSNorm is no layer norm to shard on the sequence, so a forced sequence parallelism is
# refused (planning.entry), never dropped
LLAMA = "llama:dim=32,heads=4,layers=4,batch=8,seq=8"
BATCH, BLOCKS = 8, 4
# the schedules only the per-unit planner emits, each with the searched schedule whose stage
# layout it shares (one stage per rank, or v > 1 chunks per rank)
PER_UNIT_SCHEDULES = {"gpipe": "1f1b", "zero-bubble": "interleaved-1f1b"}


@dataclasses.dataclass(frozen=True, order=True)
class Kind:
    """What of a setup changes the program that runs."""

    schedule: str  # "none" without a pipeline
    interleaved: bool  # v > 1
    tp: bool
    dp: bool
    sequence_parallel: bool
    zero: int
    recompute: str
    precision: str = "fp32"
    hybrid: bool = False  # ZeRO sharded over a part of dp (Config.dp_shard)

    def row(self) -> list[str]:
        """The kind as a table row."""
        zero = f"zero{self.zero}{' hsdp' if self.hybrid else ''}" if self.zero else ""
        return [self.schedule, "v>1" if self.interleaved else "", "tp" if self.tp else "",
                "dp" if self.dp else "", "sp" if self.sequence_parallel else "",
                zero, self.recompute, self.precision]


def space(world: int) -> list:
    """The setups the planner can choose for the test GPT on ``world`` devices of one node,
    with the per-unit planner's schedules added to every pipelined one."""
    setups = list(candidate_setups(world, world, BATCH, BLOCKS, Config()))
    extra = [dataclasses.replace(s, schedule=name)
             for s in setups if s.pp > 1
             for name, like in PER_UNIT_SCHEDULES.items() if s.schedule == like]
    return setups + extra


def kind_of(setup, precision: str = "fp32") -> Kind:
    """The kind of a setup (see the module docstring)."""
    return Kind(setup.schedule if setup.pp > 1 else "none", setup.virtual_stages > 1,
                setup.tp > 1, setup.dp > 1, setup.sequence_parallel, setup.zero, setup.recompute,
                precision, bool(setup.dp_shard))


def as_check(setup, precision: str = "fp32", model: str = MODEL) -> str:
    """The worker check that forces ``setup`` with a Config (``microbatch_size`` counts the
    samples of a microbatch over all replicas) on ``model`` (4 blocks, a batch of 8)."""
    fields = [model, f"dp={setup.dp}", f"tp={setup.tp}", f"pp={setup.pp}",
              f"recompute={setup.recompute}", f"zero={setup.zero}",
              f"sequence_parallel={int(setup.sequence_parallel)}"]
    if setup.dp_shard:
        fields.append(f"dp_shard={setup.dp_shard}")
    if setup.pp > 1:
        fields += [f"schedule={setup.schedule}", f"virtual_stages={setup.virtual_stages}",
                   f"microbatch_size={setup.microbatch_size * setup.dp}"]
    if precision == "bf16":
        fields.append("mixed_precision=bf16")
    return ",".join(fields)


def one_per_kind(world: int, model: str = MODEL) -> dict[Kind, str]:
    """The first setup of each kind (in the enumeration's order) as a worker check on
    ``model``, in fp32; and in bf16 autocast the first of each (schedule, v > 1, tp > 1,
    dp > 1) combination (bf16 changes the casts in the program, not how it is split)."""
    out: dict[Kind, str] = {}
    for setup in space(world):
        out.setdefault(kind_of(setup), as_check(setup, model=model))
    shapes: set[tuple] = set()
    for setup in space(world):
        k = kind_of(setup, "bf16")
        if (k.schedule, k.interleaved, k.tp, k.dp) not in shapes:
            shapes.add((k.schedule, k.interleaved, k.tp, k.dp))
            out[k] = as_check(setup, "bf16", model=model)
    return out

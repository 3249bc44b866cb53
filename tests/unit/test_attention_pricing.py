"""Fused attention priced at measured rates (cost_models/attention.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from autopar.capture import capture
from autopar.cost_models.attention import (ATTENTION_KERNELS, AttentionCall, attention_seconds,
                                           causal_fraction, check_rows, efficiency)
from autopar.cost_models.sharding import price_space
from autopar.cost_models.topology import Topology, custom, get_preset
from autopar.mesh import planning_device_mesh
from autopar.strategies.space import build_space

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


@pytest.mark.parametrize("preset, sweep", [("h100-dgx", "h100_kernel_sweep.json"),
                                           ("h200-dgx", "h200_kernel_sweep.json")])
def test_preset_rates_are_the_sweeps_rows(preset, sweep):
    # the tables were copied from the sweeps by hand: every measured attention row must come
    # back within 1% (the tables keep three decimals of an efficiency of 0.13-0.68)
    topo = get_preset(preset)
    rows = [r for r in json.loads((DATA / sweep).read_text())["rows"] if r["kind"] == "sdpa"]
    assert len(rows) == 40
    for r in rows:
        call = AttentionCall(r["direction"], r["causal"], r["seq"], r["seq"], r["head_dim"])
        predicted = attention_seconds(call, r["flops"], r["bytes"], "bf16", topo)
        assert predicted == pytest.approx(r["seconds"], rel=0.01), r


def test_causal_fraction_counts_the_blocks_on_and_below_the_diagonal():
    assert causal_fraction(4096, 4096) == pytest.approx(33 / 64)
    assert causal_fraction(100, 100) == 1.0  # one block: computed whole
    assert causal_fraction(1024, 4096) == 1.0  # not square: counted whole
    topo = get_preset("h100-dgx")
    flops = 4.0 * 4 * 16 * 4096 * 4096 * 128
    causal, full = (attention_seconds(AttentionCall("fwd", c, 4096, 4096, 128), flops, 0.0, "bf16",
                                      topo) for c in (True, False))
    # the same kernel skips about half of the work; the measured rates of the two differ by 11%
    assert 0.5 < causal / full < 0.6


def test_rates_between_and_beyond_measured_points():
    rows = check_rows([("fwd", False, 64, 1024, 0.4), ("fwd", False, 64, 4096, 0.6),
                       ("fwd", False, 128, 1024, 0.5), ("fwd", False, 128, 4096, 0.7)])
    assert efficiency(rows, "fwd", False, 64, 2048) == pytest.approx(0.5)  # log2 midway
    assert efficiency(rows, "fwd", False, 96, 1024) == pytest.approx(0.45)
    assert efficiency(rows, "fwd", False, 256, 65536) == pytest.approx(0.7)  # nearest
    assert efficiency(rows, "bwd", False, 64, 1024) is None
    with pytest.raises(ValueError, match=r"attention_efficiency\[0\]"):
        check_rows([("fwd", False, 64, 1024, 1.5)])


def test_topology_json_keeps_the_rates_and_old_json_loads_without_them():
    topo = get_preset("h100-dgx")
    back = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert back == topo and hash(back) == hash(topo) and back.attention_efficiency
    old = topo.to_dict()
    del old["attention_efficiency"]
    assert Topology.from_dict(old).attention_efficiency == ()
    # a topology without rates writes no key: its file loads where the field does not exist
    assert "attention_efficiency" not in get_preset("a100-dgx").to_dict()


class _CausalAttention(nn.Module):
    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().mean()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_traced_attention_is_priced_at_the_rates_of_its_local_shapes(tp):
    b, s, heads, head_dim = 2, 1024, 4, 64
    model = _CausalAttention(heads, heads * head_dim).to(torch.bfloat16)
    traced = capture(model, (torch.randn(b, s, heads * head_dim, dtype=torch.bfloat16),))
    with planning_device_mesh((tp,), ("tp",)) as dm:
        space = build_space(traced, dm, ("tp",))
    nodes = {n.target: n.name for n in traced.gm.graph.nodes if n.target in ATTENTION_KERNELS}
    assert len(nodes) == 2  # the forward and its backward
    h100 = get_preset("h100-dgx")
    no_rates = custom("h100-as-matmul", base=h100, attention_efficiency=())
    fused, as_matmul = (price_space(traced, space, t).compute for t in (h100, no_rates))
    peak = h100.peak_flops_for("bf16")
    for target, name in nodes.items():
        direction, query, _ = ATTENTION_KERNELS[target]
        # the strategy splitting the heads over tp (the only one when tp = 1: replicated)
        (i,) = [i for i, st in enumerate(space.nodes[name].strategies)
                if st.inputs[query] == ((Shard(1),) if tp > 1 else (Replicate(),))]
        flops = (4 if direction == "fwd" else 10) * b * (heads // tp) * s * s * head_dim
        n_blocks = math.ceil(s / 128)
        executed = flops * (n_blocks + 1) / (2 * n_blocks)
        rate = peak * efficiency(h100.attention_efficiency, direction, True, head_dim, s)
        assert float(fused[name][i]) == pytest.approx(executed / rate, rel=1e-6), name
        assert float(as_matmul[name][i]) == pytest.approx(flops / (peak * h100.matmul_efficiency),
                                                          rel=1e-6), name

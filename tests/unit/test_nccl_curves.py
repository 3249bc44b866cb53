"""Collectives priced by NCCL's measured bus bandwidth by message size (cost_models/nccl_curves.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cost_models.comm import all_gather_time, all_reduce_time, axis_collective_time
from autopar.cost_models.nccl_curves import H100_NODE_ALL_REDUCE_US, busbw_points
from autopar.cost_models.links import AxisLink
from autopar.cost_models.topology import Topology, custom, get_preset

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "calibration.json"


def test_the_curve_is_the_published_sweep_and_prices_its_sizes():
    # the table was copied by hand: it must equal the dataset, and the intra-node all-reduce of
    # 8 ranks must take each measured time (the two one-off slow samples left out)
    data = json.loads(DATA.read_text())
    sweep = next(d for d in data["datasets"] if d["id"] == "nccl_allreduce_h100_8gpu_sweep")
    assert [(r["bytes"], r["time_us_out_of_place"]) for r in sweep["rows"]] == \
        [tuple(p) for p in H100_NODE_ALL_REDUCE_US]
    link = get_preset("h100-dgx").intra_node
    kept = {b for b, _ in busbw_points(H100_NODE_ALL_REDUCE_US, 8)}
    assert {b for b, _ in H100_NODE_ALL_REDUCE_US} - kept == {32, 4096}
    for nbytes, us in H100_NODE_ALL_REDUCE_US:
        if nbytes in kept:
            assert all_reduce_time(nbytes, 8, link) == pytest.approx(us * 1e-6, rel=1e-9)


def test_between_and_beyond_the_measured_sizes():
    link = AxisLink(100e9, 1e-6, 5e-6, busbw_by_size=(("all_reduce", 8, ((1024, 1e9), (4096, 3e9))),))
    assert link.busbw_at("all_reduce", 2048, 8) == pytest.approx(2e9)  # log2 midway
    assert link.busbw_at("all_reduce", 2**30, 8) == 3e9  # the largest's bandwidth
    # below the smallest size the time stays at its time (a latency floor)
    assert all_reduce_time(256, 8, link) == pytest.approx(all_reduce_time(1024, 8, link))
    assert link.busbw_at("all_gather", 2048, 8) is None
    # a kind, or a rank count, without a curve keeps the alpha-beta line
    plain = AxisLink(100e9, 1e-6, 5e-6)
    assert all_gather_time(2**20, 8, link) == all_gather_time(2**20, 8, plain)
    assert all_reduce_time(2**20, 4, link) == all_reduce_time(2**20, 4, plain)
    for bad in ((("all_reduce", 8, ((1024, 1e9),)),), (("all_reduce", 8, ((1024, None), (2, 1))),),
                (("all_reduce", 1, ((1024, 1e9), (2048, 1e9))),), (("all_reduce", ((1, 1),)),)):
        with pytest.raises(ValueError, match="busbw_by_size"):
            AxisLink(1e9, 0, 0, busbw_by_size=bad)


def test_nvls_is_faster_than_the_ring_for_large_all_reduces_and_slower_in_the_middle():
    h100 = get_preset("h100-dgx")
    ring = custom("ring", base=h100, intra_node=AxisLink(370e9, h100.intra_node.latency_s,
                                                          h100.intra_node.launch_s))
    big, middle = 4 * 2**30, 16 * 2**20
    # NVLS reaches 477 GB/s at 4 GiB where a ring of 370 cannot; at 16 MiB NCCL's protocols
    # reach 237 GB/s, under the alpha-beta line's 310
    assert axis_collective_time("all_reduce", big, 8, 1, h100) < 0.8 * axis_collective_time(
        "all_reduce", big, 8, 1, ring)
    assert axis_collective_time("all_reduce", middle, 8, 1, h100) > 1.2 * axis_collective_time(
        "all_reduce", middle, 8, 1, ring)


def test_a_topology_with_curves_round_trips_and_old_json_loads():
    h100 = get_preset("h100-dgx")
    assert Topology.from_dict(json.loads(json.dumps(h100.to_dict()))) == h100
    old = h100.to_dict()
    del old["intra_node"]["busbw_by_size"]
    assert Topology.from_dict(old).intra_node.busbw_by_size == ()

"""The hardware-preset registry (cost_models/topology.py): one record per preset, registered once.

- a registered preset is usable by name: get_preset, Mesh.virtual, custom(base=...), the CLI;
- a taken name is refused unless replace=True; a non-Topology is refused; both say how to fix it;
- the preset record carries everything per preset (device type included), through JSON too, and
  JSON written before ``device_type`` existed still loads;
- every test leaves the registry as it found it (the ``registry`` fixture).
"""

from __future__ import annotations

import json
from typing import Iterator, Mapping

import pytest

import autopar
from autopar.__main__ import main
from autopar.cli import build_parser
from autopar.cost_models import (
    PRESETS,
    Topology,
    custom,
    get_preset,
    preset_names,
    register_topology,
    unregister_topology,
)

BUILTIN = {"a100-dgx", "h100-dgx", "h200-dgx", "cpu-gloo"}


@pytest.fixture
def registry() -> Iterator[Mapping[str, Topology]]:
    """The registry, restored after the test: added names removed, replaced records put back."""
    saved = dict(PRESETS)
    yield PRESETS
    for name in set(PRESETS) - set(saved):
        unregister_topology(name)
    for name, topology in saved.items():
        if PRESETS.get(name) is not topology:
            register_topology(topology, replace=True)
    assert dict(PRESETS) == saved


def _measured_h200(name: str = "h200-measured") -> Topology:
    # A user-measured node: 4 GPUs, a slower NIC and a lower measured GEMM efficiency.
    return custom(name, base="h200-dgx", gpus_per_node=4, matmul_efficiency=0.7,
                  inter_node={"bandwidth_Bps": 23e9, "latency_s": 2.7e-6, "launch_s": 6.6e-6},
                  notes="4x H200 per node, 200 Gb/s NICs (user measured)")


def test_builtin_presets_are_registered(registry):
    assert BUILTIN <= set(registry)
    assert preset_names() == tuple(sorted(registry))
    assert get_preset("cpu-gloo").device_type == "cpu"
    assert {get_preset(n).device_type for n in BUILTIN - {"cpu-gloo"}} == {"cuda"}


def test_registered_preset_is_usable_by_mesh_virtual(registry):
    mine = register_topology(_measured_h200())
    assert get_preset("h200-measured") is mine and "h200-measured" in preset_names()
    mesh = autopar.Mesh.virtual("h200-measured", nodes=2, gpus_per_node=4)
    assert mesh.topology == mine and mesh.size == 8 and mesh.device_type == "cuda"
    # the record's figures are the ones the cost model reads: a 16-rank axis leaves the node
    assert mesh.topology.link_for_axis(8, 1).bandwidth_Bps == 23e9
    # a CPU preset gives a CPU mesh, whatever its name
    register_topology(custom("lab-box", base="cpu-gloo", gpus_per_node=2))
    assert autopar.Mesh.virtual("lab-box", gpus_per_node=2).device_type == "cpu"
    # and it can be the base of another topology by name
    assert custom("h200-measured-8", base="h200-measured", gpus_per_node=8).matmul_efficiency == 0.7


def test_registered_preset_is_a_cli_choice(registry, capsys):
    argv = ["plan", "gpt-1.7b", "--hardware", "h200-measured", "--batch", "8"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)  # not registered yet: argparse refuses the choice
    register_topology(_measured_h200())
    assert build_parser().parse_args(argv).hardware.name == "h200-measured"
    # the whole command plans on it (a small preset, pp and microbatch fixed: one trace)
    assert main(["plan", "gpt2-small", "--mesh", "2x4", "--hardware", "h200-measured", "--batch",
                 "32", "--seq", "128", "--pp", "2", "--microbatch-size", "1"]) == 0
    out, err = capsys.readouterr()
    assert "for 2x4 h200-measured" in err and "autopar plan" in out
    unregister_topology("h200-measured")
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_duplicate_name_is_refused_with_a_clear_error(registry):
    register_topology(_measured_h200())
    before = dict(registry)
    with pytest.raises(ValueError) as info:
        register_topology(_measured_h200())
    message = str(info.value)
    assert "'h200-measured'" in message and "already registered" in message
    assert "replace=True" in message
    with pytest.raises(ValueError, match="'a100-dgx'.*already registered"):
        register_topology(custom("a100-dgx", base="a100-dgx", gpus_per_node=4))
    assert dict(registry) == before


def test_wrong_type_is_refused(registry):
    before = dict(registry)
    with pytest.raises(TypeError, match="expects a Topology, got dict"):
        register_topology(get_preset("a100-dgx").to_dict())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a Topology, got str"):
        register_topology("h100-dgx")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="replace must be True or False"):
        register_topology(_measured_h200(), replace="yes")  # type: ignore[arg-type]
    assert dict(registry) == before


def test_replace_true_overwrites(registry):
    register_topology(_measured_h200())
    faster = custom("h200-measured", base="h200-measured", matmul_efficiency=0.8)
    assert register_topology(faster, replace=True) is faster
    assert get_preset("h200-measured").matmul_efficiency == 0.8
    # a built-in can be replaced too (the fixture puts it back)
    four = custom("h100-dgx", base="h100-dgx", gpus_per_node=4)
    register_topology(four, replace=True)
    assert autopar.Mesh.virtual("h100-dgx", gpus_per_node=4).topology is four


def test_registry_is_read_only_and_unregister_explains(registry):
    with pytest.raises(TypeError):
        PRESETS["x"] = get_preset("a100-dgx")  # type: ignore[index]
    register_topology(_measured_h200())
    assert unregister_topology("h200-measured").name == "h200-measured"
    assert "h200-measured" not in PRESETS
    with pytest.raises(ValueError, match="no preset named 'h200-measured'.*a100-dgx"):
        unregister_topology("h200-measured")
    with pytest.raises(ValueError, match="register_topology"):
        get_preset("h200-measured")


def test_device_type_round_trips_and_old_json_loads():
    for name in BUILTIN:
        topo = get_preset(name)
        data = json.loads(json.dumps(topo.to_dict()))
        assert data["device_type"] == topo.device_type
        assert Topology.from_dict(data) == topo
        del data["device_type"]  # JSON written before the field existed
        assert Topology.from_dict(data) == topo
    with pytest.raises(ValueError, match="device_type must be one of"):
        custom("tpu", base="h100-dgx", device_type="tpu")
    # without a base, device_type (like notes) may be left out: CUDA
    fields = {k: v for k, v in get_preset("h100-dgx").to_dict().items()
              if k not in ("name", "device_type", "notes")}
    assert custom("plain", **fields).device_type == "cuda"

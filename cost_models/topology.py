"""Device topologies: per-device compute and memory figures plus intra- and inter-node links.

A :class:`Topology` describes one kind of device and the two link classes a mesh axis can use
(:class:`~autopar.cost_models.links.AxisLink`):
``intra_node`` (NVLink/NVSwitch inside a node) and ``inter_node`` (InfiniBand across nodes, one
NIC rail per GPU). Bandwidths are *bus* bandwidths in the nccl-tests sense (per device, already
effective, not line rate), so the ring formulas in :mod:`autopar.cost_models.comm` reproduce the
nccl-tests ideal times (NVIDIA/nccl-tests doc/PERFORMANCE.md).

Every preset constant cites where it comes from; ``docs/cost_model.md`` has the same table.
One constant is fitted to a training table: the ``a100-dgx`` matmul efficiency (0.657), fitted on
Megatron-LM SC'21 Table 1 rows 1, 3, 5, 7 and 9 (``[FIT]`` below). The other efficiencies are
published best-shape GEMM figures, assumed round values, or 1.0 where the peak is itself measured.

Presets live in one registry: :func:`register_topology` adds a :class:`Topology` under its name,
after which :func:`get_preset`, ``autopar.Mesh.virtual(name, ...)`` and the command line's
``--hardware`` accept it. ``PRESETS`` is a read-only view of the registry. The built-in presets
are the records of ``_BUILTIN_PRESETS`` at the end of this module, registered the same way
(``docs/adding_a_hardware_preset.md``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from autopar.cost_models.attention import H100_SDPA, H200_SDPA, check_rows
from autopar.cost_models.links import AxisLink, check_keys, check_positive
from autopar.cost_models.nccl_curves import H100_NODE_ALL_REDUCE_US, busbw_points

__all__ = [
    "Topology",
    "PRESETS",
    "DEVICE_TYPES",
    "get_preset",
    "load_topology",
    "custom",
    "register_topology",
    "unregister_topology",
    "preset_names",
]

_GiB = 1024**3

# Device types a topology may run on: the torch device of a virtual mesh built from it.
DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu")

# Accepted spellings of the dtypes whose peaks a topology lists.
_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    # fp16 tensor-core peaks equal bf16 peaks on A100/H100/H200 (NVIDIA datasheets); a topology
    # may still list "fp16" itself, which then wins.
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    # a 16-bit matmul with a row length that is not a multiple of 16 bytes (a vocabulary of
    # 50257): cuBLAS cannot feed the tensor cores with vector loads [UNAL]; priced at the
    # non-tensor 16-bit peak a topology lists under this key, else at its fp32 peak
    "bf16_unaligned": "bf16_unaligned",
}


def _as_link(owner: str, value: AxisLink | Mapping[str, Any]) -> AxisLink:
    if isinstance(value, AxisLink):
        return value
    if isinstance(value, Mapping):
        return AxisLink.from_dict(value)
    raise ValueError(f"{owner} must be an AxisLink or a dict, got {type(value).__name__}")


@dataclass(frozen=True)
class Topology:
    """Per-device hardware figures and the links between devices.

    Attributes:
        name: preset or user name, e.g. ``"h100-dgx"``.
        peak_flops: per-device peak FLOP/s by dtype; must hold ``"fp32"`` and ``"bf16"``
            (``"fp16"`` optional; defaults to the bf16 peak). fp32 is the non-tensor-core rate;
            ``"bf16_unaligned"`` (optional; defaults to fp32's) the rate of a 16-bit matmul
            whose rows the tensor cores cannot load (``compute.matmul_peak``).
        mem_bandwidth_Bps: per-device memory bandwidth (HBM or DRAM), bytes/s, nominal.
        memory_bytes: per-device memory capacity in bytes.
        intra_node: link used by an axis whose ranks all lie in one node.
        inter_node: link (per-GPU NIC rail) used by an axis that spans nodes.
        gpus_per_node: devices per node.
        matmul_efficiency: fraction of ``peak_flops`` a large GEMM reaches.
        pointwise_efficiency: fraction of ``mem_bandwidth_Bps`` a streaming kernel reaches.
        device_type: torch device type of the devices, ``"cuda"`` or ``"cpu"``
            (:data:`DEVICE_TYPES`); a virtual mesh built from this topology uses it.
        attention_efficiency: measured rates of the fused attention kernel, rows
            ``(direction, causal, head_dim, seq, efficiency)``
            (:mod:`autopar.cost_models.attention`); empty: attention priced as a matmul.
        notes: free text (hardware description); not compared, not hashed.
    """

    name: str
    peak_flops: dict[str, float]
    mem_bandwidth_Bps: float
    memory_bytes: float
    intra_node: AxisLink
    inter_node: AxisLink
    gpus_per_node: int
    matmul_efficiency: float
    pointwise_efficiency: float
    device_type: str = "cuda"
    attention_efficiency: tuple = ()
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Topology.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.peak_flops, Mapping):
            raise ValueError(
                f"Topology.peak_flops must be a dict like {{'fp32': ..., 'bf16': ...}}, "
                f"got {type(self.peak_flops).__name__}"
            )
        peaks = {str(k): float(v) for k, v in self.peak_flops.items()}
        missing = sorted({"fp32", "bf16"} - set(peaks))
        if missing:
            raise ValueError(f"Topology.peak_flops is missing {missing} (has {sorted(peaks)})")
        for key, value in peaks.items():
            check_positive("Topology", f"peak_flops[{key!r}]", value)
        object.__setattr__(self, "peak_flops", peaks)
        check_positive("Topology", "mem_bandwidth_Bps", self.mem_bandwidth_Bps)
        check_positive("Topology", "memory_bytes", self.memory_bytes)
        object.__setattr__(self, "intra_node", _as_link("Topology.intra_node", self.intra_node))
        object.__setattr__(self, "inter_node", _as_link("Topology.inter_node", self.inter_node))
        if (
            not isinstance(self.gpus_per_node, int)
            or isinstance(self.gpus_per_node, bool)
            or self.gpus_per_node < 1
        ):
            raise ValueError(
                f"Topology.gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}"
            )
        for name in ("matmul_efficiency", "pointwise_efficiency"):
            value = getattr(self, name)
            check_positive("Topology", name, value)
            if value > 1.0:
                raise ValueError(f"Topology.{name} must be in (0, 1], got {value!r}")
        object.__setattr__(self, "attention_efficiency", check_rows(self.attention_efficiency))
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(
                f"Topology.device_type must be one of {list(DEVICE_TYPES)}, "
                f"got {self.device_type!r}"
            )

    def __hash__(self) -> int:
        return hash(
            (
                self.name,
                tuple(sorted(self.peak_flops.items())),
                self.mem_bandwidth_Bps,
                self.memory_bytes,
                self.intra_node,
                self.inter_node,
                self.gpus_per_node,
                self.matmul_efficiency,
                self.pointwise_efficiency,
                self.device_type,
                self.attention_efficiency,
            )
        )

    def peak_flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``: "fp32", "bf16", "fp16" or torch names ("torch.float32")."""
        key = str(dtype).removeprefix("torch.").lower()
        if key not in _DTYPE_ALIASES:
            raise ValueError(
                f"unknown dtype {dtype!r} for peak FLOP/s; use one of {sorted(_DTYPE_ALIASES)}"
            )
        canon = _DTYPE_ALIASES[key]
        if canon == "fp16" and "fp16" not in self.peak_flops:
            canon = "bf16"
        if canon == "bf16_unaligned" and canon not in self.peak_flops:
            canon = "fp32"  # no non-tensor figure listed: the vector unit's fp32 rate
        return self.peak_flops[canon]

    def link_for_axis(self, axis_size: int, stride: int) -> AxisLink:
        """The link an axis of ``axis_size`` ranks uses, given its ``stride``.

        ``stride`` is the product of the sizes of the inner (later) mesh axes, i.e. the rank
        distance between neighbours on this axis with row-major rank numbering, nodes outermost.
        The axis stays inside one node iff ``stride * axis_size <= gpus_per_node``.
        """
        for label, value in (("axis_size", axis_size), ("stride", stride)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"link_for_axis: {label} must be an int >= 1, got {value!r}")
        if stride * axis_size <= self.gpus_per_node:
            return self.intra_node
        return self.inter_node

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (``json.dumps`` works on it); inverse of :meth:`from_dict`.
        ``attention_efficiency`` only when it has rows (a file without it loads in releases
        before it)."""
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "mem_bandwidth_Bps": float(self.mem_bandwidth_Bps),
            "memory_bytes": float(self.memory_bytes),
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "gpus_per_node": int(self.gpus_per_node),
            "matmul_efficiency": float(self.matmul_efficiency),
            "pointwise_efficiency": float(self.pointwise_efficiency),
            "device_type": self.device_type,
            "notes": self.notes,
        } | ({"attention_efficiency": [list(row) for row in self.attention_efficiency]}
             if self.attention_efficiency else {})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        """Build a topology from :meth:`to_dict` output; ``notes`` and ``device_type`` are optional.

        JSON written before ``device_type`` existed loads as before: a name starting with
        ``"cpu"`` means CPU devices, any other name CUDA devices.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"Topology.from_dict expects a mapping, got {type(data).__name__}")
        expected = {f.name for f in dataclasses.fields(cls)}
        legacy_device = "cpu" if str(data.get("name", "")).startswith("cpu") else "cuda"
        check_keys("Topology", {"notes": "", "device_type": legacy_device,
                                 "attention_efficiency": (), **data}, expected)
        return cls(
            name=str(data["name"]),
            peak_flops=dict(data["peak_flops"]),
            mem_bandwidth_Bps=float(data["mem_bandwidth_Bps"]),
            memory_bytes=float(data["memory_bytes"]),
            intra_node=AxisLink.from_dict(data["intra_node"]),
            inter_node=AxisLink.from_dict(data["inter_node"]),
            gpus_per_node=int(data["gpus_per_node"]),
            matmul_efficiency=float(data["matmul_efficiency"]),
            pointwise_efficiency=float(data["pointwise_efficiency"]),
            device_type=str(data.get("device_type", legacy_device)),
            attention_efficiency=tuple(tuple(r) for r in data.get("attention_efficiency", ())),
            notes=str(data.get("notes", "")),
        )


# ---------------------------------------------------------------------------------------------
# The preset registry.

_REGISTRY: dict[str, Topology] = {}

#: Read-only view of the registered presets, by name. Add to it with :func:`register_topology`.
PRESETS: Mapping[str, Topology] = MappingProxyType(_REGISTRY)


def register_topology(topology: Topology, *, replace: bool = False) -> Topology:
    """Register ``topology`` as a preset under ``topology.name`` and return it.

    Afterwards :func:`get_preset`, ``autopar.Mesh.virtual(name, ...)``, ``custom(..., base=name)``
    and ``python -m autopar plan --hardware name`` accept the name. A name already registered is
    refused unless ``replace=True``, which puts ``topology`` in its place.

    Example::

        register_topology(custom("h200-nvl4", base="h200-dgx", gpus_per_node=4))

    Raises:
        TypeError: ``topology`` is not a :class:`Topology` (or ``replace`` is not a bool).
        ValueError: the name is taken and ``replace`` is false.
    """
    if not isinstance(topology, Topology):
        raise TypeError(
            f"register_topology expects a Topology, got {type(topology).__name__} "
            f"({topology!r:.80}); build one with Topology(...), custom(name, base=...) or "
            f"Topology.from_dict(data)"
        )
    if not isinstance(replace, bool):
        raise TypeError(f"register_topology: replace must be True or False, got {replace!r}")
    current = _REGISTRY.get(topology.name)
    if current is not None and not replace:
        raise ValueError(
            f"register_topology: a preset named {topology.name!r} is already registered "
            f"({current.notes or 'no notes'}); pass replace=True to overwrite it, or register "
            f"the new topology under another name: custom('{topology.name}-2', base=<it>)"
        )
    _REGISTRY[topology.name] = topology
    return topology


def unregister_topology(name: str) -> Topology:
    """Remove the preset ``name`` from the registry and return it (e.g. to restore a registry
    after a test); ``ValueError`` listing the registered names if there is none."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"unregister_topology: no preset named {name!r}; registered: "
            f"{', '.join(preset_names())}"
        )
    return _REGISTRY.pop(name)


def preset_names() -> tuple[str, ...]:
    """The registered preset names, sorted (the command line's ``--hardware`` choices)."""
    return tuple(sorted(_REGISTRY))


def get_preset(name: str) -> Topology:
    """Return the preset topology ``name``; ``ValueError`` listing the valid names otherwise."""
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]
    raise ValueError(
        f"unknown topology preset {name!r}; valid presets: {', '.join(preset_names())}; "
        f"add one with register_topology(custom({name!r}, base=<preset>, ...))"
    )


def load_topology(spec: "str | os.PathLike | Topology") -> Topology:
    """A topology from a registered preset name, a JSON file written by
    ``python -m autopar calibrate`` (or ``json.dump(topology.to_dict(), f)``), or a
    :class:`Topology` (returned as it is).

    Raises ``ValueError`` naming the registered presets when ``spec`` is neither a preset nor
    an existing file, and ``Topology.from_dict``'s error when the file is not a topology.
    """
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, str) and spec in _REGISTRY:
        return _REGISTRY[spec]
    path = Path(os.fspath(spec)) if isinstance(spec, (str, os.PathLike)) else None
    if path is None or not path.is_file():
        raise ValueError(
            f"topology {spec!r} is neither a registered preset ({', '.join(preset_names())}) "
            f"nor a topology JSON file; write one with `python -m autopar calibrate --out "
            f"my.json` or json.dump(topology.to_dict(), f)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"topology file {str(path)!r} is not JSON: {e}") from e
    return Topology.from_dict(data)


def custom(name: str, *, base: str | Topology | None = None, **fields: Any) -> Topology:
    """Build a user topology (not registered: pass it to :func:`register_topology` for that).

    With ``base`` (a preset name or a Topology) the given ``fields`` override that topology's
    values; without it every field of :class:`Topology` without a default (all but
    ``device_type`` and ``notes``) must be given. Links may be passed as :class:`AxisLink` or as
    dicts with the same keys.

    Example: ``custom("my-a100", base="a100-dgx", gpus_per_node=4)``.
    """
    allowed = {f.name for f in dataclasses.fields(Topology)} - {"name"}
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise ValueError(f"custom({name!r}): unknown fields {unknown}; valid: {sorted(allowed)}")
    if base is not None:
        start = get_preset(base) if isinstance(base, str) else base
        if not isinstance(start, Topology):
            raise ValueError(
                f"custom({name!r}): base must be a preset name or a Topology, "
                f"got {type(start).__name__}"
            )
        values = {f.name: getattr(start, f.name) for f in dataclasses.fields(Topology)}
        values.update(fields)
        values["name"] = name
        return Topology(**values)
    optional = {
        f.name for f in dataclasses.fields(Topology) if f.default is not dataclasses.MISSING
    }
    missing = sorted(allowed - optional - set(fields))
    if missing:
        raise ValueError(
            f"custom({name!r}): missing fields {missing}; give them or pass base=<preset name>"
        )
    return Topology(name=name, **fields)


# ---------------------------------------------------------------------------------------------
# The built-in presets: one record each. Sources (also in docs/cost_model.md):
#  [MEG]   Narayanan et al., SC'21, arXiv:2104.04473 (Selene DGX A100: NVSwitch, 8x200 Gb/s HDR).
#  [A100W] NVIDIA A100 Tensor Core GPU datasheet/whitepaper: 312 TFLOP/s bf16 dense, 19.5 TFLOP/s
#          fp32, 80 GB HBM2e at 2.0 TB/s, NVLink3 600 GB/s bidirectional (300 per direction).
#  [H100D] NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 80 GB HBM3 at
#          3.35 TB/s, NVLink4 900 GB/s bidirectional (450 per direction).
#  [H200D] NVIDIA H200 SXM datasheet: same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s.
#  [HOPW]  NVIDIA Hopper architecture in-depth (developer blog, Table 3) and H100 whitepaper:
#          H100 SXM5 non-tensor BF16 and FP16 at twice the non-tensor FP32 rate (133.8 of 66.9
#          TFLOP/s at the final boost clock).
#  [UNAL]  measured on one H200 (torch 2.11, cuBLAS of CUDA 13.0; benchmarks/kernel_sweep.py,
#          benchmarks/data/h200_kernel_sweep.json): bf16 x @ w.T GEMMs with 50257 outputs ran at
#          83-107 TFLOP/s (7.4-9.6x the aligned roofline), with 32000 or 32768 at 577-713; fp32
#          unaffected. Priced at the non-tensor 16-bit peak times the matmul efficiency, these
#          rows are predicted within 0.77-1.0 of the measured times. The A100 figure is the same
#          rule, unmeasured.
#  [NT]    measured nccl-tests bus bandwidths collected in benchmarks/data/calibration.json
#          ("measured_collective_bandwidths"): A100 8-GPU all_reduce 232.5 GB/s
#          (NVIDIA/nccl-tests#175), ~200 (#149); 2 A100 nodes with 4 HDR NICs 86 GB/s, i.e. 21.5
#          per NIC (#175; #119: 84.8 avg); H100 ring 365-370 GB/s for any collective
#          (NVIDIA/nccl-tests#212, NVIDIA/nccl#1442, #1455); NDR 400 Gb/s 46-48 GB/s per NIC
#          (NVIDIA/nccl-tests#290); H200 8-GPU all_reduce 475 (NVLS, #272).
#  [NCCL]  NVIDIA/nccl src/graph/tuning.cc latency tables: ring LL per-hop hwLat 0.6 us (NVLink),
#          2.7 us (network); ring LL baseLat 6.6 us. With 8 GPUs this predicts 6.6 + 14 * 0.6 =
#          15 us for a small all_reduce, matching the 13-17 us of the 8x H100 nccl-tests sample
#          (NVIDIA/dgxc-benchmarking nccl/README.md, quoted in benchmarks/data/calibration.json).
#  [MAMF]  Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum
#          Achievable Matmul FLOPS comparison table" (bf16 matmul, best shape): A100 SXM 267.9 of
#          312 (85.9%), H100 SXM 792.1 of 989 (80.1%), GH200 821.0 of 989 (83.0%).
#  [FIT]   a100-dgx matmul efficiency: fitted once by `python benchmarks/megatron_table1.py
#          --calibrate` (bisection on the mean log error of Megatron's configurations, Narayanan
#          et al. SC'21 Table 1, rows 1, 3, 5, 7 and 9; rows 2, 4, 6, 8 and 10 held out): 0.657.
#  [STREAM] Streaming-kernel efficiency. STREAM-style copy/triad kernels (McCalpin 1995) do not
#          reach nominal HBM bandwidth; 0.85 is an ASSUMED round value, not a measurement, and the
#          per-preset calibration pass is expected to replace it.
#  [DGXC]  NVIDIA/dgxc-benchmarking nccl/README.md: all_reduce_perf on one 8x H100 node, 8 B to
#          16 GiB (cost_models/nccl_curves.py).
#  [SWEEP] attention: torch 2.11's bf16 scaled_dot_product_attention timed by
#          benchmarks/kernel_sweep.py on one H100 and one H200 (cost_models/attention.py).
#  [LOCAL] cpu-gloo: measured once on this 2-core CPU machine with 4 gloo ranks under torchrun
#          (OMP_NUM_THREADS=1): fp32 1024^3 matmul 29-31 GFLOP/s per rank, bf16 matmul 0.4-0.9
#          GFLOP/s (no native bf16 GEMM on this CPU), out-of-place add 8 GB/s per rank with 4 ranks
#          streaming at once; all_reduce of 16 B: 1-5 ms, of 16 MiB: 50-62 ms (earlier runs on
#          this kind of machine: ~1 ms and ~50 ms). Noisy: the machine is shared.
# ---------------------------------------------------------------------------------------------

# Ring latencies from [NCCL] (LL protocol, used for the small messages where latency matters).
_NCCL_LAUNCH_S = 6.6e-6
_NVLINK_HOP_S = 0.6e-6
_NET_HOP_S = 2.7e-6

# NCCL's all-reduce inside an 8-GPU NVLink4/NVSwitch node, by message size [DGXC].
_H100_NODE_CURVES = (("all_reduce", 8, busbw_points(H100_NODE_ALL_REDUCE_US, 8)),)

# One table: each record is the whole preset (figures, efficiencies, device type).
_BUILTIN_PRESETS: tuple[Topology, ...] = (
    Topology(
        name="a100-dgx",
        # [A100W], [MEG]; bf16_unaligned: the non-tensor bf16 peak [A100W] (rule [UNAL])
        peak_flops={"fp32": 19.5e12, "bf16": 312e12, "bf16_unaligned": 39e12},
        mem_bandwidth_Bps=2.0e12,  # [A100W] (80 GB SXM: 2.039 TB/s; DESIGN rounds to 2.0)
        memory_bytes=80 * _GiB,  # [A100W] 80 GB part reports 81920 MiB
        # NVSwitch gen2: 300 GB/s per direction line rate; measured ring busbw ~232.5 GB/s
        # [NT]. AxisLink's first field is the bus bandwidth in bytes/s.
        intra_node=AxisLink(230e9, latency_s=_NVLINK_HOP_S, launch_s=_NCCL_LAUNCH_S),
        # 8x 200 Gb/s HDR, one rail per GPU = 25 GB/s line rate; measured ~21.5 GB/s per NIC
        # [NT].
        inter_node=AxisLink(21.5e9, latency_s=_NET_HOP_S, launch_s=_NCCL_LAUNCH_S),
        gpus_per_node=8,
        # [FIT] the one constant fitted to a training table (Megatron-LM's own runs on this
        # hardware, SC'21 Table 1 rows 1, 3, 5, 7, 9); the best-shape GEMM figure [MAMF]
        # 267.9 / 312 = 0.859 overstates sustained training (Table 1 predicted 12-26% high).
        matmul_efficiency=0.657,
        pointwise_efficiency=0.85,  # [STREAM] assumed
        device_type="cuda",
        notes="DGX A100 80GB (Selene): NVSwitch gen2, 8x HDR 200 Gb/s per node",
    ),
    Topology(
        name="h100-dgx",
        # [H100D]; bf16_unaligned: the non-tensor bf16 peak, twice fp32's [HOPW] (rule [UNAL])
        peak_flops={"fp32": 67e12, "bf16": 989e12, "bf16_unaligned": 134e12},
        mem_bandwidth_Bps=3.35e12,  # [H100D]
        memory_bytes=80 * _GiB,  # [H100D]
        # NVLink4: 450 GB/s per direction line rate; ring busbw ~370 GB/s for any collective
        # [NT]; all_reduce by the measured sweep [DGXC] (NVLS: ~480 GB/s at 4 GiB and up).
        intra_node=AxisLink(370e9, latency_s=_NVLINK_HOP_S, launch_s=_NCCL_LAUNCH_S,
                            busbw_by_size=_H100_NODE_CURVES),
        # 8x 400 Gb/s NDR, one rail per GPU = 50 GB/s line rate; measured 46-48 GB/s per NIC
        # [NT].
        inter_node=AxisLink(bandwidth_Bps=47e9, latency_s=_NET_HOP_S, launch_s=_NCCL_LAUNCH_S),
        gpus_per_node=8,
        matmul_efficiency=0.801,  # [MAMF] H100 SXM 792.1 / 989
        pointwise_efficiency=0.85,  # [STREAM] assumed
        device_type="cuda",
        attention_efficiency=H100_SDPA,  # [SWEEP] measured on one H100
        notes="DGX H100: NVLink4/NVSwitch gen3, 8x NDR 400 Gb/s per node",
    ),
    Topology(
        name="h200-dgx",
        # [H200D] same GH100 compute as H100 SXM (and its non-tensor bf16 peak [HOPW])
        peak_flops={"fp32": 67e12, "bf16": 989e12, "bf16_unaligned": 134e12},
        mem_bandwidth_Bps=4.8e12,  # [H200D]
        memory_bytes=141e9,  # [H200D] "141 GB"
        # Same NVLink4 fabric as DGX H100: ring busbw ~370 GB/s [NT]; all_reduce by the H100
        # node's sweep [DGXC] (#272's 475 GB/s on 8 H200s is the same NVLS peak).
        intra_node=AxisLink(370e9, latency_s=_NVLINK_HOP_S, launch_s=_NCCL_LAUNCH_S,
                            busbw_by_size=_H100_NODE_CURVES),
        # DGX H200 ships the same 8x NDR 400 Gb/s rails as DGX H100 [NT].
        inter_node=AxisLink(bandwidth_Bps=47e9, latency_s=_NET_HOP_S, launch_s=_NCCL_LAUNCH_S),
        gpus_per_node=8,
        # [MAMF] lists no H200; use the H100 SXM figure (same die and power envelope; GH200:
        # 83.0%).
        matmul_efficiency=0.801,
        pointwise_efficiency=0.85,  # [STREAM] assumed
        device_type="cuda",
        attention_efficiency=H200_SDPA,  # [SWEEP] measured on one H200
        notes="DGX H200: H100 compute with 141 GB HBM3e at 4.8 TB/s, NVLink4, 8x NDR 400 Gb/s",
    ),
    Topology(
        name="cpu-gloo",
        # [LOCAL]: measured achieved rates, so the efficiencies below are 1.0 (folded in).
        peak_flops={"fp32": 30e9, "bf16": 0.5e9},
        mem_bandwidth_Bps=8e9,  # [LOCAL] per rank, 4 ranks streaming together
        memory_bytes=6 * _GiB,  # 24 GiB machine shared by 4 ranks
        # [LOCAL] gloo over loopback, alpha-beta fit: 4-rank all_reduce(16 B) =
        # 1e-3 + 6 * 2.5e-4 = 2.5 ms; all_reduce(16 MiB) = 2.5 ms + 1.5 * 16 MiB / 4e8 B/s = 65 ms.
        intra_node=AxisLink(bandwidth_Bps=4e8, latency_s=2.5e-4, launch_s=1e-3),
        inter_node=AxisLink(bandwidth_Bps=4e8, latency_s=2.5e-4, launch_s=1e-3),
        gpus_per_node=4,
        matmul_efficiency=1.0,
        pointwise_efficiency=1.0,
        device_type="cpu",
        notes="4 gloo ranks on one 2-core CPU machine (measured once; rough)",
    ),
)

for _preset in _BUILTIN_PRESETS:
    register_topology(_preset)
del _preset

"""``autopar.Mesh``: the devices a plan is made for (a running job, or a virtual cluster)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from datetime import timedelta
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from autopar.cost_models.topology import Topology, load_topology
from autopar.errors import MeshError

__all__ = ["Mesh", "planning_device_mesh"]


@dataclass(frozen=True)
class Mesh:
    """A physical cluster: ``nodes`` x ``devices_per_node`` devices with a cost topology.

    Build it with :meth:`from_torchrun` inside a job (the devices that will run the plan) or with
    :meth:`virtual` to plan for hardware you do not have. The logical (dp, tp) mesh is chosen by
    the planner; this object only describes the physical devices. ``timeout_s`` bounds how long
    a rank of a running job waits in a collective for the others (a dead or hung rank): ``None``
    keeps torch's default (30 minutes on gloo, 10 on NCCL).
    """

    nodes: int
    devices_per_node: int
    topology: Topology
    device_type: str = "cpu"
    is_virtual: bool = True
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise MeshError(
                f"Mesh(nodes={self.nodes}, devices_per_node={self.devices_per_node}): both must "
                f"be >= 1."
            )
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise MeshError(f"Mesh(timeout_s={self.timeout_s!r}): must be a positive number of "
                            f"seconds, or None for torch's default.")
        if self.topology.gpus_per_node != self.devices_per_node:
            # the cost model tells intra- from inter-node links by the topology's node size:
            # it must be this cluster's (a100-dgx has 8 GPUs a node; a 2-GPU-node cluster of
            # the same parts has 2)
            object.__setattr__(self, "topology", dataclasses.replace(
                self.topology, gpus_per_node=self.devices_per_node))

    @property
    def size(self) -> int:
        """Number of devices."""
        return self.nodes * self.devices_per_node

    @classmethod
    def virtual(
        cls, preset: str | os.PathLike | Topology, nodes: int = 1, gpus_per_node: int = 8
    ) -> "Mesh":
        """A cluster to plan for without devices, e.g. ``Mesh.virtual("h100-dgx", nodes=128)``.

        ``preset`` is a registered preset name (see
        :func:`autopar.cost_models.register_topology`), a topology JSON file (``python -m
        autopar calibrate --out my.json`` writes one) or a :class:`Topology`; the mesh's device
        type is the topology's ``device_type``.
        """
        if not isinstance(preset, (str, os.PathLike, Topology)):
            raise MeshError(
                f"Mesh.virtual(preset={preset!r}): give a preset name, a topology JSON file or "
                f"a Topology, got {type(preset).__name__}."
            )
        topo = load_topology(preset)
        return cls(nodes, gpus_per_node, topo, device_type=topo.device_type, is_virtual=True)

    @classmethod
    def from_torchrun(cls, topology: str | os.PathLike | Topology | None = None,
                      timeout_s: float | None = None) -> "Mesh":
        """The world of the running job (``torchrun`` sets ``WORLD_SIZE``/``RANK``).

        Initialises the default process group if needed: NCCL when CUDA is available, gloo
        otherwise. CPU ranks get the ``cpu-gloo`` topology; GPUs default to ``h100-dgx``;
        ``topology`` may name another preset, a topology JSON file or be a :class:`Topology`.
        ``timeout_s``: how long a collective waits for a dead or hung rank before every other
        rank raises :class:`~autopar.RankFailureError` (the default process group gets it too
        when this call creates it); ``None`` keeps torch's default.
        """
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise MeshError(
                    "Mesh.from_torchrun() found no running job: RANK and WORLD_SIZE are not set "
                    "and no process group is initialised. Launch with `torchrun "
                    "--nproc_per_node=N script.py`, or use Mesh.virtual(...) to plan only."
                )
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":  # one GPU per rank, as torchrun numbers them on the node
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
            dist.init_process_group(backend, **kwargs)
        use_cuda = dist.get_backend() == "nccl"
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % local:
            raise MeshError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}.")
        if topology is None:
            topology = "h100-dgx" if use_cuda else "cpu-gloo"
        topo = load_topology(topology)
        return cls(world // local, local, topo, "cuda" if use_cuda else "cpu", is_virtual=False,
                   timeout_s=timeout_s)

    def check_world(self) -> None:
        """Raise :class:`MeshError` unless the running job has exactly ``size`` ranks."""
        if not dist.is_initialized():
            raise MeshError(
                f"running a plan needs a process group of {self.size} ranks; none is "
                f"initialised. Launch with torchrun and build the mesh with Mesh.from_torchrun()."
            )
        world = dist.get_world_size()
        if world != self.size:
            raise MeshError(
                f"the mesh has {self.size} devices ({self.nodes} x {self.devices_per_node}) but "
                f"the job has {world} ranks. Use Mesh.from_torchrun() to match the job, or launch "
                f"torchrun with --nproc_per_node={self.size}."
            )

    def describe(self) -> str:
        """One line for tables: ``2 x 8 h100-dgx``."""
        return f"{self.nodes} x {self.devices_per_node} {self.topology.name}"


@contextlib.contextmanager
def planning_device_mesh(
    shape: Sequence[int], names: Sequence[str]
) -> Iterator["torch.distributed.device_mesh.DeviceMesh"]:
    """A DeviceMesh of any shape for strategy enumeration, without real ranks or collectives.

    DTensor's rules need a default process group to exist; when there is none, the single-process
    "fake" backend is initialised for the duration and torn down afterwards.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from autopar import _torch_private as private

    n = 1
    for s in shape:
        n *= s
    created = False
    if not dist.is_initialized():
        private.init_fake_process_group(n)
        created = True
    try:
        mesh = DeviceMesh(
            "cpu", torch.arange(n).view(*shape), mesh_dim_names=tuple(names), _init_backend=False
        )
        yield mesh
    finally:
        if created:
            dist.destroy_process_group()

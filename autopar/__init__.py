"""autopar: automatic parallelization of PyTorch training.

    mesh = autopar.Mesh.from_torchrun()
    pmodel = autopar.parallelize(model, mesh, example_inputs=(ids, labels))
    loss = pmodel.step(ids, labels)
"""

from autopar.api import parallelize, plan, search
from autopar.checkpoint import load_checkpoint, save_checkpoint
from autopar.config import Config
from autopar.cost_models.passes import cost_pass
from autopar.errors import (
    AutoparError,
    CaptureError,
    InputMismatchError,
    MeshError,
    PlanError,
    RankFailureError,
    UnsupportedOpError,
)
from autopar.mesh import Mesh
from autopar.plan import Collective, Plan
from autopar.runtime.module import ParallelModule
from autopar.runtime.profile import profile_step
from autopar.solver.ilp import InfeasibleMemoryError
from autopar.strategies.rules import register_op_rule

__all__ = [
    "AutoparError", "CaptureError", "Collective", "Config", "InfeasibleMemoryError",
    "InputMismatchError", "Mesh", "MeshError", "ParallelModule", "Plan", "PlanError",
    "RankFailureError",
    "UnsupportedOpError", "cost_pass", "load_checkpoint", "parallelize", "plan",
    "profile_step", "register_op_rule", "save_checkpoint", "search",
]

__version__ = "0.1.0"

"""Error types of autopar. Each message says what was given, what was required and how to fix it."""

from __future__ import annotations

__all__ = [
    "AutoparError",
    "CaptureError",
    "MeshError",
    "InputMismatchError",
    "UnsupportedOpError",
    "PlanError",
    "RankFailureError",
]


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be traced into one whole forward+backward graph."""


class MeshError(AutoparError):
    """The mesh does not match the running job or the requested degrees."""


class InputMismatchError(AutoparError, ValueError):
    """Inputs do not match the model's signature or the example inputs the plan was made for."""


class UnsupportedOpError(AutoparError):
    """An operator has no sharding rule and ``Config.unknown_op == "error"``."""


class PlanError(AutoparError):
    """A plan cannot be made, loaded or applied (no feasible plan, wrong model, corrupt file)."""


class RankFailureError(AutoparError, RuntimeError):
    """A collective of a running job failed: another rank died, or did not answer within the
    mesh's timeout (``Mesh.from_torchrun(timeout_s=...)``). Raised on every rank that noticed,
    with the backend's own error as its ``__cause__``."""

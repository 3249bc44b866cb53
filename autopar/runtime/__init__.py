"""Runtime: the parallel module that executes a plan."""

from autopar.runtime.module import ParallelModule

__all__ = ["ParallelModule"]

"""FX passes over the traced graph (``GraphModule, Plan -> GraphModule``), as ``autopar.passes``."""

from autopar.passes.lower import lower_to_local

__all__ = ["lower_to_local"]

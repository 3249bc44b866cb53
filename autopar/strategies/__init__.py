"""Per-op sharding strategies: DTensor's rules, autopar's own, and the strategy space."""

from autopar.strategies.rules import OpRule, register_op_rule, registered_rules
from autopar.strategies import release_rules as _release_rules  # noqa: F401  (older torch)

__all__ = ["OpRule", "register_op_rule", "registered_rules"]

"""Cost models: topology, compute (roofline), communication (alpha-beta) and memory.

Imported as ``autopar.cost_models``. Every formula and constant is documented with its source in
``docs/cost_model.md``.
"""

from autopar.cost_models.comm import (
    COLLECTIVE_KINDS,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    axis_collective_time,
    collective_time,
    reduce_scatter_time,
    send_recv_time,
)
from autopar.cost_models.compute import (
    EXTRA_FLOP_FORMULAS,
    bytes_of_node,
    flops_of_node,
    op_time,
)
from autopar.cost_models import experts as _experts  # noqa: F401  (registers the MoE op's FLOPs)
from autopar.cost_models.links import AxisLink
from autopar.cost_models.memory import (
    StateBytes,
    adam_state_bytes_per_param,
    optimizer_state_bytes_per_param,
    training_state_breakdown,
    training_state_bytes_per_param,
    zero_sharded_bytes_per_param,
)
from autopar.cost_models.pipeline import (
    SCHEDULES,
    ScheduleResult,
    action_order,
    check_schedule,
    closed_form_bubble,
    in_flight,
    simulate,
)
from autopar.cost_models.topology import (
    DEVICE_TYPES,
    PRESETS,
    Topology,
    custom,
    get_preset,
    load_topology,
    preset_names,
    register_topology,
    unregister_topology,
)

__all__ = [
    # topology
    "AxisLink",
    "Topology",
    "PRESETS",
    "DEVICE_TYPES",
    "get_preset",
    "load_topology",
    "custom",
    "register_topology",
    "unregister_topology",
    "preset_names",
    # communication
    "COLLECTIVE_KINDS",
    "all_reduce_time",
    "all_gather_time",
    "reduce_scatter_time",
    "all_to_all_time",
    "send_recv_time",
    "collective_time",
    "axis_collective_time",
    # compute
    "EXTRA_FLOP_FORMULAS",
    "op_time",
    "flops_of_node",
    "bytes_of_node",
    # memory
    "StateBytes",
    "training_state_breakdown",
    "training_state_bytes_per_param",
    "adam_state_bytes_per_param",
    "optimizer_state_bytes_per_param",
    "zero_sharded_bytes_per_param",
    # pipeline schedules
    "SCHEDULES",
    "ScheduleResult",
    "simulate",
    "in_flight",
    "action_order",
    "check_schedule",
    "closed_form_bubble",
]

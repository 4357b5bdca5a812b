"""pipeloom.schedules: the action IR, schedule generators, lowering, validation, simulation.

Pure Python (stdlib only): nothing here knows about processes or tensors.
"""

from __future__ import annotations

from .action import COMM_TYPES, COMPUTE_TYPES, Action, ActionParseError, ActionType, parse_action
from .dataflow import Dataflow, TransferKey, consumer_stage, producer_stage, transfer_kind
from .generators import (
    SCHEDULE_NAMES,
    ScheduleConfigError,
    canonical_name,
    default_stages_per_rank,
    generate,
    placement_style,
)
from .lowering import add_reduce_grad, add_send_recv, add_unshard_reshard, lower, merge_bw, overlap_input_only
from .schedule import (
    Schedule,
    ScheduleError,
    dump_csv,
    dumps_csv,
    format_grid,
    infer_stage_to_rank,
    load_csv,
    loads_csv,
    loop_mapping,
    v_mapping,
)
from .policy_sim import POLICIES, policy_ceiling, simulate_policy
from .simulate import Costs, SimulationResult, TimedEvent, simulate
from .validate import InvalidScheduleError, ScheduleProblem, check, validate

__all__ = [
    "Action",
    "ActionParseError",
    "ActionType",
    "COMM_TYPES",
    "COMPUTE_TYPES",
    "Costs",
    "Dataflow",
    "InvalidScheduleError",
    "SCHEDULE_NAMES",
    "Schedule",
    "ScheduleConfigError",
    "ScheduleError",
    "ScheduleProblem",
    "SimulationResult",
    "TimedEvent",
    "TransferKey",
    "add_reduce_grad",
    "add_send_recv",
    "add_unshard_reshard",
    "canonical_name",
    "check",
    "consumer_stage",
    "default_stages_per_rank",
    "dump_csv",
    "dumps_csv",
    "format_grid",
    "generate",
    "infer_stage_to_rank",
    "load_csv",
    "loads_csv",
    "loop_mapping",
    "lower",
    "merge_bw",
    "overlap_input_only",
    "parse_action",
    "placement_style",
    "producer_stage",
    "simulate",
    "simulate_policy",
    "policy_ceiling",
    "POLICIES",
    "transfer_kind",
    "v_mapping",
    "validate",
]

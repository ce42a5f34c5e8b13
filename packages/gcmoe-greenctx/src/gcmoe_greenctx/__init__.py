"""gcmoe-greenctx: SM partitions with CUDA Green Contexts, their streams, and captured layer graphs."""

from .graph import LayerGraph, LayerGraphCache, RoleNodes, enqueue_roles
from .partition import (
    GreenContextError,
    Partition,
    SmFacts,
    SplitPlan,
    device_facts,
    plan_split,
    release,
    split_device,
    valid_comm_sizes,
)

__version__ = "0.1.0"

__all__ = [
    "GreenContextError",
    "LayerGraph",
    "LayerGraphCache",
    "Partition",
    "RoleNodes",
    "SmFacts",
    "SplitPlan",
    "device_facts",
    "enqueue_roles",
    "plan_split",
    "release",
    "split_device",
    "valid_comm_sizes",
]

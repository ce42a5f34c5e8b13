"""gcmoe-greenctx: SM partitions with CUDA Green Contexts and their streams, streams a component owns, set-up outside
a caller's capture, a layer's role nodes (fork / join) to enqueue or capture, and the eager launch of a captured graph
(gcmoe_greenctx.launch: its argument copy and launch, two ctypes driver calls)."""

from .graph import RoleNodes, enqueue_roles
from .partition import (
    GreenContextError,
    Partition,
    SmFacts,
    SplitPlan,
    device_facts,
    plan_split,
    split_device,
    valid_comm_sizes,
)
from .streams import OwnedStream, capturing, relaxed_capture

__version__ = "0.1.0"

__all__ = [
    "GreenContextError",
    "OwnedStream",
    "Partition",
    "RoleNodes",
    "SmFacts",
    "SplitPlan",
    "capturing",
    "device_facts",
    "enqueue_roles",
    "plan_split",
    "relaxed_capture",
    "split_device",
    "valid_comm_sizes",
]

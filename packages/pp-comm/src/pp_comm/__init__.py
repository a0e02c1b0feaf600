"""pp-comm: point-to-point transfers between pipeline stages.

`P2PCommunicator` offers Megatron-LM's nine operations (``recv_forward``, ``send_forward``,
``send_forward_recv_backward``, ...) and a general ``exchange`` of any number of
`P2PMessage` objects, batched or not, with fixed or variable shapes, on gloo and NCCL, and
turns a lost transfer into an error that names the rank, the peer and the operation.
"""

from importlib.metadata import version as _version

from pp_comm.communicator import (
    CommConfig,
    P2PCommunicator,
    P2PHandle,
    P2PMessage,
    Payload,
    Received,
)
from pp_comm.errors import P2PError, P2PMismatchError, P2PTimeoutError
from pp_comm.framing import FrameBuffers, frame_buffers
from pp_comm.ordering import SLOTS, Slot, batched_order, find_deadlock, unbatched_order
from pp_comm.payload import ShapesArg, TensorSpec
from pp_comm.timers import NullTimers, Timer, Timers

__version__ = _version("pp-comm")

__all__ = [
    "SLOTS",
    "CommConfig",
    "FrameBuffers",
    "NullTimers",
    "P2PCommunicator",
    "P2PError",
    "P2PHandle",
    "P2PMessage",
    "P2PMismatchError",
    "P2PTimeoutError",
    "Payload",
    "Received",
    "ShapesArg",
    "Slot",
    "TensorSpec",
    "Timer",
    "Timers",
    "__version__",
    "batched_order",
    "find_deadlock",
    "frame_buffers",
    "unbatched_order",
]

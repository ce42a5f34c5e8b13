"""Streams a component owns, and set-up work that must stay out of a caller's CUDA-graph capture.

Why our own streams (OwnedStream): torch.cuda.Stream() hands out the streams of a pool of 32 per priority
round-robin, so a component that takes one per object gets, past 32 objects, a stream that may be the very one a
caller is capturing; synchronising or recording set-up work on it then breaks that capture.

Why relaxed capture mode (relaxed_capture): under a capture in the default (global) mode, a "potentially unsafe" call
from any thread (allocation, module load, a destroy) invalidates the capture. Set-up of a layer first called inside
a caller's capture, and the teardown of an object the garbage collector drops during one, run in relaxed mode for
this thread, on streams that are not captured.
"""

from __future__ import annotations

import contextlib

import torch


def capturing(stream: torch.cuda.Stream) -> bool:
    """Whether `stream` is part of a capture now (any capture, not only the current stream's)."""
    from cuda.bindings import driver

    err, status = driver.cuStreamIsCapturing(driver.CUstream(stream.cuda_stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"gcmoe: cuStreamIsCapturing failed: {err}")
    return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


@contextlib.contextmanager
def relaxed_capture():
    """This thread in relaxed stream-capture mode for the block (the previous mode restored after it)."""
    from cuda.bindings import runtime

    _, prev = runtime.cudaThreadExchangeStreamCaptureMode(runtime.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
    try:
        yield
    finally:
        runtime.cudaThreadExchangeStreamCaptureMode(prev)


class OwnedStream:
    """A non-blocking runtime stream created for one owner (never drawn from torch's pool), destroyed by close() or
    when dropped. `.stream` is the torch view of it."""

    def __init__(self, device: torch.device | int):
        from cuda.bindings import runtime

        device = torch.device("cuda", device) if isinstance(device, int) else device
        with torch.cuda.device(device):
            err, handle = runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking)
        if err != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"gcmoe: creating a stream on {device} failed: {err}")
        self._handle = handle
        self.stream = torch.cuda.ExternalStream(int(handle), device=device)

    def close(self) -> None:
        """Destroy the stream (work already enqueued on it still completes). Safe during a capture elsewhere."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is None:
            return
        try:
            from cuda.bindings import runtime

            with relaxed_capture():
                runtime.cudaStreamDestroy(handle)
        except Exception:  # (interpreter shutdown: the driver may be gone already)
            pass

    def __del__(self):
        self.close()

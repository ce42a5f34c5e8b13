"""The two driver calls of an eager call through a captured graph, each one C call through ctypes: the host-to-device
copy of the call's argument block and the graph's launch.

    exec_ = graph.raw_cuda_graph_exec()                    # after capture (torch.cuda.CUDAGraph)
    err = copy_then_launch(dst, src, nbytes, exec_, stream) # 0, or the CUresult of the call that failed

Why not cuda-python or CUDAGraph.replay: the binding builds a CUstream / CUdeviceptr object per call and replay()
sets a device guard and walks the RNG states first; per eager layer call that is several µs of host time, which a
58-layer eager step pays 58 times (gcmoe-lab probe host_time times each step). The calls act in the calling thread's
current CUDA context: a caller whose current device is not the graph's, or a thread with no current context (error
201, CUDA_ERROR_INVALID_CONTEXT), takes the caller's slow path (torch's own, which sets the device first).
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    copy = lib.cuMemcpyHtoDAsync_v2
    copy.argtypes = (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    copy.restype = ctypes.c_int
    launch = lib.cuGraphLaunch
    launch.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    launch.restype = ctypes.c_int
    return copy, launch


def copy_then_launch(dst: int, src: int, nbytes: int, graph_exec: int, stream: int) -> int:
    """nbytes from host address src (pinned) to device address dst, then the graph executable, both on `stream` (a
    raw handle). 0 on success, else the failing call's CUresult (nothing after a failed copy is launched)."""
    copy, launch = _driver()
    return copy(dst, src, nbytes, stream) or launch(graph_exec, stream)

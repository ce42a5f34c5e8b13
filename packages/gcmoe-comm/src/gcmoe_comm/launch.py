"""The launch shape the comm kernels (kernels.py) and their host side (comm.py) agree on; no CuTe DSL, so the host
checks a ring spec without importing the kernels.

Every comm kernel runs THREADS threads per CTA. Dispatch ranks the routing in WARPS chunks, one per warp, each with
row cursors of its own; it keeps every rank's routing ids (2 bytes each) and those cursors (WARPS * P * (E/P + S)
int32) in shared memory, at most MAX_DISPATCH_SMEM bytes.
"""

THREADS = 256
WARPS = THREADS // 32
MAX_DISPATCH_SMEM = 200 * 1024

"""Offline: compile the warp-specialised W2 / W1 (h i n_tile producers) for sm_90a; registers, spills, setmaxnreg."""

import sys
import time
from dataclasses import replace

from gcmoe_core.cutedsl import disassemble, resource_usage
from gcmoe_gemm_sm90.config import choose_config
from gcmoe_gemm_sm90.kernel_ws import compiled_ws, ws_config

h, i, n, p = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
base = choose_config(128, 8, 32, h, i, 132, 1)
cfg = ws_config(replace(base, n_tile=n), h, i)
print(cfg)
for mode, m, k in (("w2", h, i), ("w1", 2 * i, h)):
    t = time.time()
    c = compiled_ws(mode, m, k, cfg, "sm_90a", p)
    print(mode, "P", p, "compiled", round(time.time() - t, 1), "s", resource_usage(c.cubin))
    s = disassemble(c.cubin)
    print("LDL/STL", s.count("LDL"), s.count("STL"), "QGMMA", s.count("QGMMA"), "SETMAXREG", s.count("SETMAXREG"))
    for line in s.splitlines():
        if any(op in line for op in ("SETMAXREG", "EXIT", "BAR.SYNC", "BAR.ARV")):
            print("   ", line.strip()[:120])

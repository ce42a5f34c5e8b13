"""One process per GPU for checks on PyTorch symmetric memory: the launcher the comm multi-process tests and the
lab's multi-GPU harness share.

    records = spawn_ranks(worker, p, out_dir, *args)   # worker(rank, p, store, out_dir, *args) in P fresh processes
    dev = init_rank(rank, p, store)                     # in a worker: its GPU and the P-rank NCCL group
    with rank_record(out_dir, {"rank": rank}) as res:   # the worker's outcome -> out_dir/rank<r>.json, never raises
        ...

NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1). A rank
that fails leaves its peers inside a collective: COLLECTIVE_TIMEOUT_S ends that wait instead of a hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVE_TIMEOUT_S = 90.0


def init_rank(rank: int, p: int, store: str):
    """This process's GPU and its membership of the P-rank NCCL group (file rendezvous at `store`), multicast off."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=p, device_id=dev, timeout=timeout
    )
    return dev


@contextlib.contextmanager
def rank_record(out_dir: str, res: dict):
    """The body's outcome in res (ok, or error + traceback: recorded for the parent, which reports every rank), its
    wall time, written to out_dir/rank<r>.json; the process group torn down. Never raises."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        yield res
        res["ok"] = True
    except Exception as e:
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    finally:
        res["wall_s"] = time.perf_counter() - t0
        Path(out_dir, f"rank{res['rank']}.json").write_text(json.dumps(res, indent=2))
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(worker, p: int, out: str, *args) -> list[dict]:
    """worker(rank, p, store, out, *args) in P fresh processes; their rank records (a rank that died without one:
    {"ok": False, "error": "no record"})."""
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)
    Path(out).mkdir(parents=True, exist_ok=True)
    for f in Path(out).glob("rank*.json"):
        f.unlink()
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(worker, args=(p, f"{d}/store", out, *args), nprocs=p, join=True)
        except Exception as e:  # a rank that died: reported below through its missing or failed record
            print(f"spawn: {type(e).__name__}: {e}")
    recs = []
    for r in range(p):
        f = Path(out, f"rank{r}.json")
        recs.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "ok": False, "error": "no record"})
    return recs

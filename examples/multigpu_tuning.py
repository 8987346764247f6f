"""Several ranks tune into one ``tuning.json`` at the same time; a second launch times nothing.

    torchrun --nproc-per-node 2 examples/multigpu_tuning.py --cache-dir /tmp/tbl            # tunes
    torchrun --nproc-per-node 2 examples/multigpu_tuning.py --cache-dir /tmp/tbl --expect-warm

Every rank pre-tunes (``lycoris_ops.warmup``) the layer shapes all ranks share plus
one shape of its own, on its own GPU, into the same table, all at once. The table
is merged under a file lock and replaced atomically (``lycoris_ops/tuner/store.py``),
so the file afterwards holds every rank's rows. The proof is the second launch:
every rank finds every key in the table and times nothing (a lost row would be
timed again). Exit status 1 if a rank timed anything under ``--expect-warm``, if
the table is not valid JSON, or if any warm-up call failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

OPS = ["lora_bypass_fwd", "lora_bypass_bwd", "lora_merge_fwd", "lokr_bypass_fwd", "lokr_bypass_bwd",
       "ia3_fwd", "add_scaled"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--shapes", default="3072x3072:r32,12288x3072:r32")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--expect-warm", action="store_true")
    args = ap.parse_args(argv)
    os.environ["LYCORIS_KERNEL_CACHE_DIR"] = args.cache_dir  # before the package reads it
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import lycoris_ops
    from lycoris_ops.tuner import tune

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        print("multigpu_tuning: no CUDA device; nothing to tune")
        return 0
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    shapes = args.shapes.split(",") + [f"{1024 + 256 * rank}x3072:r16"]  # one shape per rank
    tune.set_tuning(True)
    if world > 1:
        dist.barrier()  # start together, so the writers really overlap
    s = lycoris_ops.warmup(shapes, tokens=[int(t) for t in args.tokens.split(",")], dtype=torch.bfloat16,
                           device=device, ops=OPS, backward=True)
    st = tune.stats()
    mine = dict(rank=rank, device=str(device), calls=s["calls"], tuned=s["tuned"], table_hits=s["table_hits"],
                timer_calls=st["timer_calls"], seconds=s["seconds"], errors=s["errors"])
    every = [None] * world
    if world > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    status = 0
    if rank == 0:
        path = tune.table_path()
        try:
            rows = json.load(open(path))["rows"]
            table = f"{len(rows)} rows, valid JSON"
        except Exception as exc:
            table, status = f"UNREADABLE: {exc}", 1
        print(f"table {path}: {table}")
        for m in every:
            print(f"  rank {m['rank']} ({m['device']}): {m['calls']} calls, {m['tuned']} keys tuned, "
                  f"{m['table_hits']} table hits, {m['timer_calls']} timer calls, {m['seconds']:.1f} s")
            for e in m["errors"]:
                print("    error:", e)
                status = 1
            if args.expect_warm and (m["tuned"] or m["timer_calls"]):
                print(f"    rank {m['rank']} timed in the warm launch: a row was lost")
                status = 1
        print("shared table:", "PASS" if status == 0 else "FAIL")
    if world > 1:
        t = torch.tensor([status], device=device)
        dist.all_reduce(t)
        status = int(t.item() > 0)
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())

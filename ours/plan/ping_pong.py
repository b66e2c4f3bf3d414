"""The gloo ping-pong every point-to-point timing of the suite runs: the planner's profile (two local
processes), the simulator's stall probe and the network tests (two virtual hosts).

    python -m ours.plan.ping_pong RANK BYTES REPS [REPLY_BYTES]   # one of the two ranks; the rendezvous
                                                                  # at $MASTER_ADDR:$MASTER_PORT
Rank 0 prints one JSON line: {"bytes", "reply_bytes", "round_trip" (the median, s), "round_trips"}.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def ping_pong(rank: int, nbytes: int, reps: int, *, reply_bytes: int | None = None, barrier: bool = False,
              warmup: int = 2) -> list[float]:
    """Round-trip times (s) of ``reps`` ping-pongs between ranks 0 and 1 of the default (gloo) group,
    after ``warmup`` unmeasured ones: rank 0 sends ``nbytes`` (whole fp32 elements, at least one) and
    waits for the reply of ``reply_bytes`` (default: as many); rank 1 receives, then replies.
    ``barrier``: both ranks start each round together. Both ranks get the times they saw."""
    ping = torch.zeros(max(1, nbytes // 4))
    pong = torch.zeros(max(1, (nbytes if reply_bytes is None else reply_bytes) // 4))
    times = []
    for i in range(warmup + reps):
        if barrier:
            dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(ping, 1)
            dist.recv(pong, 1)
        else:
            dist.recv(ping, 0)
            dist.send(pong, 0)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def main(argv: list[str]) -> int:
    rank, nbytes, reps = int(argv[0]), int(argv[1]), int(argv[2])
    reply = int(argv[3]) if len(argv) > 3 else nbytes
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=2, timeout=timedelta(seconds=60))
    times = ping_pong(rank, nbytes, reps, reply_bytes=reply)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"bytes": nbytes, "reply_bytes": reply, "round_trip": statistics.median(times),
                          "round_trips": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

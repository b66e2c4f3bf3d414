"""One rank of a 2-rank gloo point-to-point timing (run inside a virtual host).

rank 0 sends N bytes to rank 1 and waits for a 1-element acknowledgement; prints the median round in ms.
"""
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank, nbytes, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=rank, world_size=2, timeout=timedelta(seconds=60))
x = torch.zeros(nbytes // 4)
ack = torch.zeros(1)
times = []
for i in range(iters + 2):  # two warm-up rounds
    t = time.perf_counter()
    if rank == 0:
        dist.send(x, 1)
        dist.recv(ack, 1)
    else:
        dist.recv(x, 0)
        dist.send(ack, 0)
    if i >= 2:
        times.append((time.perf_counter() - t) * 1e3)
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    print(json.dumps({"median_ms": statistics.median(times), "times_ms": times}))

"""The smallest reproduction of torchrun restarts that fail to recover (no trinity-train code).

    torchrun --standalone --nproc-per-node=2 --max-restarts=2 benchmarks/restart_repro.py [INIT_TIMEOUT_S]

Two gloo ranks all-reduce in a loop; in the first attempt rank 1 kills itself (SIGKILL). torchrun
restarts both workers, which must join a new process group and finish. With torch 2.13's c10d
rendezvous the restarted workers share the agent's TCPStore with the killed attempt
(`DynamicRendezvousHandler` keeps one `_shared_tcp_store_server` for every round), so gloo can read
the dead worker's address and fail in connectFullMesh ("Connection refused") or wait in it.
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives every round a fresh store hosted by the new rank 0:
see benchmarks/restart_recovery.py for the measured difference and benchmarks/README.md.
Rank 0 ends with a one-row table of the attempt that finished (its only import from this
repository: the harness's stdlib-only table formatter).
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from trinity_harness.table import markdown_table

timeout = datetime.timedelta(seconds=float(sys.argv[1]) if len(sys.argv) > 1 else 1800)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timeout)
print(f"rank {rank} attempt {attempt} joined", flush=True)
x = torch.ones(1)
ALL_REDUCES = 20
for i in range(ALL_REDUCES):
    dist.all_reduce(x)
    if attempt == 0 and rank == 1 and i == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
dist.barrier()
time.sleep(0.2)  # let gloo's threads drain (see parallel/process_group.py)
dist.destroy_process_group()
print(f"rank {rank} attempt {attempt} done", flush=True)
if rank == 0:
    print(markdown_table(["ranks", "attempt that finished (restarts)", "all-reduces", "process-group timeout s"],
                         [[int(os.environ["WORLD_SIZE"]), attempt, ALL_REDUCES, f"{timeout.total_seconds():g}"]]),
          flush=True)

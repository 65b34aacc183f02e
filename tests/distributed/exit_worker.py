"""One rank of a short gloo job that ends without cleaning up (tests/distributed/test_exit.py).

Run as a script, as torchrun would run one::

    python -m tests.distributed.exit_worker WRAPPER RANK WORLD PORT

WRAPPER: "ours" (BucketedDDP), "sharded" (BucketedDDP + ShardedOptimizer) or "torch"
(DistributedDataParallel). The rank trains a tiny model
for a few steps and returns without ``destroy_process_group()``, so the process ends through the
interpreter's normal finalization, as a torchrun or ``mp.spawn`` worker does (a fork or forkserver
``multiprocessing`` child would skip it with ``os._exit``, and does not show the abort).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from torch_flashsys import BucketedDDP, ShardedOptimizer

STEPS = 3


def main(wrapper: str, rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if wrapper == "sharded":  # the job's last collectives: ShardedOptimizer's broadcasts
        model = BucketedDDP(net)
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        for _ in range(STEPS):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return
    model = BucketedDDP(net) if wrapper == "ours" else nn.parallel.DistributedDataParallel(net)
    for _ in range(STEPS):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        with torch.no_grad():  # SGD by hand: torch.optim imports torch._dynamo (seconds)
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None


if __name__ == "__main__":
    wrapper, rank, world, port = sys.argv[1:5]
    main(wrapper, int(rank), int(world), int(port))

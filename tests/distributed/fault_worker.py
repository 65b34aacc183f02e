"""One rank of a training run in which rank 1 fails on purpose (tests/distributed/test_faults.py).

Run as a script, as torchrun would run one (its exit status is what the test checks)::

    python -m tests.distributed.fault_worker POINT MODE RANK WORLD PORT TIMEOUT_S

POINT: where rank 1 fails, in its second step: "forward", "backward" (mid-way: after some
buckets started), "allreduce" (right after starting its second bucket's all-reduce) or "step"
(inside ShardedOptimizer.step(), after the local update, before the parameter exchange).
MODE: "raise" (an exception, as a bug would), "kill" (SIGKILL, as the OOM killer would), "hang"
(alive but silent: the others must time out after TIMEOUT_S, the process group's timeout) or
"raise_caught" (an exception the training loop catches before going on to the next step).
The other ranks run the same loop and do nothing special: an uncaught exception exits with 1.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from torch_flashsys import BucketedDDP, ShardedOptimizer
from torch_flashsys.distributed import _buckets

FAILING_RANK, FAILING_STEP = 1, 1


def fail(mode: str, point: str) -> None:
    print(f"injected {mode} at {time.time()}", file=sys.stderr, flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        time.sleep(3600)
    raise RuntimeError(f"injected failure on rank {FAILING_RANK} in {point}")


def main(point: str, mode: str, rank: int, world: int, port: int, timeout_s: float) -> None:
    """Train 4 steps; an exception (injected, or a failed collective) is logged with the time
    it reached the top, then propagates."""
    try:
        _train(point, mode, rank, world, port, timeout_s)
    except BaseException:
        print(f"failed at {time.time()}", file=sys.stderr, flush=True)
        raise


def run_rank(
    point: str, mode: str, rank: int, world: int, port: int, timeout_s: float, log: str
) -> None:
    """``main`` with stdout and stderr sent to ``log`` (a multiprocessing target: an uncaught
    exception exits with status 1, as the script would)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    main(point, mode, rank, world, port, timeout_s)


def _train(point: str, mode: str, rank: int, world: int, port: int, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    model = BucketedDDP(net, bucket_size_mb=0)  # one bucket per parameter: 6 all-reduces
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    failing = rank == FAILING_RANK
    step = 0

    def at(where: str) -> None:
        if failing and step == FAILING_STEP and point == where:
            fail(mode, where)

    def in_backward(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        # The middle layer's output gradient: reached after the last layer's buckets started.
        output.register_hook(lambda grad: at("backward"))

    net[0].register_forward_hook(lambda *_: at("forward"))
    net[2].register_forward_hook(in_backward)
    real_all_reduce, launched = _buckets.all_reduce, []

    def all_reduce(group: dist.ProcessGroup, tensor: torch.Tensor, op: dist.ReduceOp):
        work = real_all_reduce(group, tensor, op)
        launched.append(step)
        if launched.count(step) == 2:
            at("allreduce")
        return work

    _buckets.all_reduce = all_reduce
    opt.optim.register_step_post_hook(lambda *_: at("step"))
    for step in range(4):  # noqa: B007 (at() reads it)
        loss = model(torch.randn(16, 8)).pow(2).mean()
        try:
            loss.backward()
        except RuntimeError as exc:  # "raise_caught": the user's loop goes on after the error
            if mode != "raise_caught" or "injected failure" not in str(exc):
                raise
            print("caught the injected failure; going on", file=sys.stderr, flush=True)
            continue
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    print("finished", file=sys.stderr, flush=True)


if __name__ == "__main__":
    point, mode, rank, world, port, timeout_s = sys.argv[1:7]
    main(point, mode, int(rank), int(world), int(port), float(timeout_s))

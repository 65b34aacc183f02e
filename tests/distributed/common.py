"""Helpers shared by the distributed tests: hypothesis settings and strategies of the spawned
ShardedOptimizer tests, the types of the training helpers, and :func:`attempt` for rank bodies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch import nn

# The training helpers' arguments: a wrapper (BucketedDDP, torch DDP, identity) applied to the
# model, and per step the micro-batches, each ``(forward args, target)``.
Wrap = Callable[[nn.Module], nn.Module]
Batches = list[list[tuple[tuple, torch.Tensor]]]


def attempt(fn: Callable[[], Any]) -> str:
    """Call ``fn()`` and say how it went: ``"Type: message"`` of what it raised, or ``"no error"``
    (rank bodies return this, so that the test compares every rank's outcome)."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def spawning(max_examples: int) -> settings:
    """Settings for a test that spawns process groups (seconds per example): few examples, no
    deadline, and the blob to reproduce a failure."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )


# The model and optimizer of a training case (zero_cases.py / zero2_cases.py build them).
MODEL_FIELDS = {
    "seed": st.integers(0, 2**20),
    "optimizer": st.sampled_from(["sgd", "adam", "adamw"]),
    "vocab": st.integers(2, 11),
    "d": st.integers(1, 7),
    "widths": st.lists(st.integers(1, 9), min_size=0, max_size=3),
    "tied": st.booleans(),
    "frozen": st.booleans(),
    "scalar": st.booleans(),
    "groups": st.integers(1, 3),
}

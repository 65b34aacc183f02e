"""ShardedOptimizer internals: moving per-parameter optimizer state between ranks for checkpoints.

``gather_states`` collects every rank's state on one rank without pickling the large tensors:
small values (and 0-dim tensors such as Adam's ``step``) travel in one ``gather_object``; every
other tensor is sent point-to-point, one at a time, so neither side ever holds more than one extra
state tensor on the device. The gathered state lives on the CPU (as in torch's
ZeroRedundancyOptimizer), so consolidating never needs the full state in device memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torch_flashsys.distributed._verify import collective_device

State = dict[int, dict[str, Any]]  # global parameter index -> that parameter's state


class _Sent(NamedTuple):
    """Placeholder for a state tensor that follows point-to-point."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(states: State) -> tuple[State, list[torch.Tensor]]:
    """``states`` with every non-0-dim tensor replaced by a ``_Sent``, and those tensors in order."""
    meta: State = {}
    bulk: list[torch.Tensor] = []
    for index in sorted(states):
        entry = {}
        for key, value in states[index].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = _Sent(tuple(value.shape), value.dtype)
                bulk.append(value)
            elif isinstance(value, torch.Tensor):
                entry[key] = value.detach().cpu().clone()
            else:
                entry[key] = value
        meta[index] = entry
    return meta, bulk


def _to_cpu(states: State) -> State:
    return {
        index: {
            k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in entry.items()
        }
        for index, entry in states.items()
    }


def gather_states(
    states: State, to: int, group: dist.ProcessGroup, global_ranks: list[int]
) -> State | None:
    """Merge every rank's ``states`` (disjoint keys) on group rank ``to``, as CPU tensors.

    A collective: every rank of ``group`` calls it. Returns the merged state on ``to``, ``None``
    elsewhere.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = collective_device(group)
    meta, bulk = _split(states)
    metas: list[Any] | None = [None] * world if rank == to else None
    dist.gather_object(meta, metas, dst=global_ranks[to], group=group)
    if rank != to:
        for t in bulk:
            dist.send(t.detach().contiguous().to(device), dst=global_ranks[to], group=group)
        return None
    merged: State = {}
    for src, src_meta in enumerate(metas or []):
        if src == rank:
            merged.update(_to_cpu(states))
            continue
        for index, entry in src_meta.items():
            for key, value in entry.items():
                if isinstance(value, _Sent):
                    buf = torch.empty(value.shape, dtype=value.dtype, device=device)
                    dist.recv(buf, src=global_ranks[src], group=group)
                    entry[key] = buf.cpu()
            merged[index] = entry
    return dict(sorted(merged.items()))


def check_plain_format(
    caller: str, state_dict: Any, group_sizes: list[int]
) -> tuple[Mapping[Any, Any], list[dict[str, Any]]]:
    """Validate a plain ``optimizer.state_dict()``-style dict against the current param groups.

    Returns its ``state`` and ``param_groups``; raises ``TypeError``/``ValueError`` naming
    ``caller`` otherwise.
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise TypeError(
            f"{caller}: expected a dict with 'state' and 'param_groups' (an optimizer "
            f"state_dict()), got {type(state_dict).__name__}"
            + (
                f" with keys {sorted(map(str, state_dict))}"
                if isinstance(state_dict, Mapping)
                else ""
            )
        )
    groups = state_dict["param_groups"]
    saved_sizes = [len(g["params"]) for g in groups]
    if saved_sizes != group_sizes:
        raise ValueError(
            f"{caller}: the state dict's parameter groups do not match this optimizer's: it has "
            f"{len(saved_sizes)} group(s) of sizes {saved_sizes}, this optimizer has "
            f"{len(group_sizes)} of sizes {group_sizes}"
        )
    expected = list(range(sum(group_sizes)))
    if [i for g in groups for i in g["params"]] != expected:
        raise ValueError(
            f"{caller}: the state dict's parameter indices must number the parameters 0..{len(expected) - 1} "
            "in group order (the format of torch.optim.Optimizer.state_dict())"
        )
    state = state_dict["state"]
    unknown = sorted(set(state) - set(expected), key=str)
    if unknown:
        raise ValueError(
            f"{caller}: the state dict has state for unknown parameter indices {unknown[:5]}; "
            f"valid indices are 0..{len(expected) - 1}"
        )
    return state, list(groups)

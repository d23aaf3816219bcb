"""The torchrun process group as the trainer and the checkpoints use it: rank and world, the
few collectives a training step and a checkpoint need, no-ops for a single process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, device_type: str | None = None) -> Distributed:
        """The torchrun group; its backend follows the job's device (``device_type``, default:
        CUDA when there is one), so CPU ranks on a GPU host use gloo, not NCCL."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not torch.distributed.is_initialized():
            on_gpu = (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
            torch.distributed.init_process_group("nccl" if on_gpu else "gloo")
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool, device) -> bool:
        if self.world == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return bool(value.item())

    def sum(self, value: float, device) -> float:
        if self.world == 1:
            return value
        tensor = torch.tensor([value], device=device, dtype=torch.float64)
        torch.distributed.all_reduce(tensor)
        return float(tensor.item())

    def flags_any(self, flags: list[bool], device) -> list[bool]:
        """Each flag OR-ed over the ranks, in one all-reduce."""
        if self.world == 1:
            return list(flags)
        value = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return [bool(v) for v in value.tolist()]

    def gather_objects(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def broadcast_object(self, obj, src: int):
        """``src``'s ``obj`` on every rank (a checkpoint share's listing)."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Fill ``tensor`` on every rank with ``src``'s, in place."""
        if self.world > 1:
            torch.distributed.broadcast(tensor, src=src)


class ReplicasDiffer(RuntimeError):
    """The ranks of one training job hold different weights."""


def check_replicas(module: torch.nn.Module, group) -> None:
    """Every rank must hold the same weights: each writes only its share of the checkpoint
    (training.checkpoint), so diverged replicas would be saved mixed. A float64 sum per
    parameter, gathered; DDP's all-reduced updates keep them bitwise equal. Raises naming the
    first parameters that differ, so a gradient path outside DDP's reduction is found loudly."""
    if group.world == 1:
        return
    sums = {name: float(p.detach().double().sum()) for name, p in module.named_parameters()}
    ranks = group.gather_objects(sums)
    differ = sorted({name for other in ranks[1:] for name in sums if other.get(name) != ranks[0].get(name)})
    if differ:
        raise ReplicasDiffer(
            f"the {group.world} ranks hold different weights in {len(differ)} parameters "
            f"(first: {', '.join(differ[:3])}); their checkpoint shards would not fit together"
        )

"""Data-parallel training under torchrun: one process per rank, one shard of each batch each.

::

    torchrun --standalone --nproc-per-node N -m attnkit.train RECIPE [options]

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR / MASTER_PORT) in each worker;
:func:`init_distributed` reads them and starts ``torch.distributed`` (gloo on CPU, nccl on a
GPU). The :class:`~attnkit.training.trainer.Trainer` then wraps the model in
DistributedDataParallel. Each step, every rank builds the same global batch (a pure function
of (seed, epoch, index)) and keeps rows ``rank::world`` (:func:`shard_batch`). The loss of a
rank is weighted so that DDP's gradient average is the single-process gradient exactly::

    rank r:  L_r = mean loss over its n_r real tokens,  N = sum_r n_r  (all-reduced)
    backward on  L_r * n_r * world / N   ->  DDP averages over ranks  ->  sum_r L_r n_r / N

so the global batch size, the loss and the gradient do not depend on the world size, and an
uneven split (batch_size not a multiple of world) is still exact. Gradients are all-reduced
inside ``backward``, so clipping afterwards sees the global gradient, the same on every rank.

FSDP2 (``torch.distributed.fsdp.fully_shard``) runs on CPU/gloo in torch 2.13, but the trainer
does not shard yet: its checkpoints would need a gather of the full state dict first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["STRATEGIES", "DistEnv", "cleanup", "init_distributed", "shard_batch", "torchrun_env"]

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: rank ``rank`` of ``world`` (``local_rank`` on its node)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def torchrun_env() -> DistEnv:
    """RANK / WORLD_SIZE / LOCAL_RANK from the environment (torchrun's); a single process when
    they are missing."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as error:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({error})") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world} do not fit (need 0 <= RANK < WS)")
    return DistEnv(rank, world, local)


def init_distributed() -> DistEnv:
    """Join the process group torchrun set up (once; later calls return the same). A single
    process (no WORLD_SIZE, or 1) starts nothing."""
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), torchrun_env().local_rank)
    env = torchrun_env()
    if not env.enabled:
        return env
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", env.local_rank))
    else:
        dist.init_process_group("gloo")
    return DistEnv(dist.get_rank(), dist.get_world_size(), env.local_rank)


def cleanup() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_batch(batch: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    """Rows ``rank::world`` of every tensor of a global batch (dimension 0 is the batch)."""
    if world == 1:
        return batch
    return {key: value[rank::world] for key, value in batch.items()}

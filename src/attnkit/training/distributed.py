"""Data-parallel and sharded training under torchrun: one process per rank, a share of each batch.

::

    torchrun --standalone --nproc-per-node N -m attnkit.train RECIPE [--strategy ddp|fsdp]

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR / MASTER_PORT) in each worker;
:func:`init_distributed` reads them and starts ``torch.distributed`` (gloo on CPU, nccl on a
GPU). The :class:`~attnkit.training.trainer.Trainer` then wraps the model in
DistributedDataParallel (every rank holds the whole model) or shards it with FSDP2
(:func:`shard_model`: each rank holds 1/N of every parameter, gradient and optimizer state).
Each step, every rank builds the same global batch (a pure function of (seed, epoch, index)),
keeps rows ``rank::world`` (:func:`shard_batch`) and cuts them into ``train.accumulate``
micro-batches (:func:`split_batch`). Each micro-batch contributes the *sum* of its token losses
to the gradient; after the last one, the ranks all-reduce their token counts and the
gradient is divided by the global count::

    rank r, micro-batch m:  L_rm = mean loss over its n_rm real tokens
    backward on  L_rm * n_rm  (no gradient sync until the last micro-batch)
    DDP / FSDP average over the ranks:  g = (1 / world) sum_rm n_rm grad L_rm
    N = sum_rm n_rm (all-reduced);  g * world / N = sum_rm n_rm grad L_rm / N

so the global batch size, the loss and the gradient do not depend on the world size or the
number of micro-batches, and an uneven split (batch_size not a multiple of world) is still
exact. Clipping comes after, so it sees the global gradient, the same on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnkit.training.config import resolve_device

__all__ = [
    "STRATEGIES",
    "DistEnv",
    "cleanup",
    "full_model_state",
    "full_optimizer_state",
    "global_loss",
    "gradient_sync",
    "init_distributed",
    "load_full_model_state",
    "load_full_optimizer_state",
    "shard_batch",
    "shard_model",
    "split_batch",
    "torchrun_env",
    "wrap_model",
]

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
    """Leave the process group, if this process joined one: after a barrier, so that no rank
    tears its connections down while another still works (rank 0 plots and prints after the
    last collective); a rank that died makes the barrier fail at once, and then the others just
    leave (torchrun is stopping the job anyway)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # sharded modules and their communication state go first
        try:
            dist.barrier()
        except RuntimeError:
            pass
        dist.destroy_process_group()


def shard_batch(batch: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    """Rows ``rank::world`` of every tensor of a global batch (dimension 0 is the batch)."""
    if world == 1:
        return batch
    return {key: value[rank::world] for key, value in batch.items()}


def split_batch(batch: dict[str, Tensor], parts: int) -> list[dict[str, Tensor]]:
    """``parts`` micro-batches of consecutive rows (sizes differing by at most one); every
    tensor is split along dimension 0. Each part must get at least one row."""
    rows = next(iter(batch.values())).shape[0]
    if not 1 <= parts <= rows:
        raise ValueError(f"split_batch: cannot cut {rows} rows into {parts} micro-batches")
    if parts == 1:
        return [batch]
    pieces = {key: value.tensor_split(parts) for key, value in batch.items()}
    return [{key: pieces[key][i] for key in batch} for i in range(parts)]


# --------------------------------------------------------------------------------------------
# FSDP2: sharding, and full (world-size independent) state for checkpoints
# --------------------------------------------------------------------------------------------


def shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    Each encoder / decoder layer is one unit (its parameters are gathered just before its
    forward and freed after; in backward, its gradients are reduce-scattered); the root unit
    holds the rest: embeddings (tied with the output layer, so they must stay together), final
    norms, heads. ``model.loss`` is registered as a forward method, so the fused training loss
    gathers the root's parameters as ``forward`` does. Returns the same object.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            for layer in module:
                fully_shard(layer)
    fully_shard(model)
    if callable(getattr(model, "loss", None)):
        register_fsdp_forward_method(model, "loss")
    return model


def _options(to_cpu_on_rank0: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=to_cpu_on_rank0)


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole state dict of a sharded model, gathered on every rank (a collective: every
    rank must call it). The names are those of the unsharded model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(False))


def load_full_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a whole state dict (the same on every rank) into a sharded model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(False))


def full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
) -> dict[str, Any]:
    """The optimizer state of a sharded model, gathered on rank 0 (empty elsewhere; every rank
    must call it), in ``optimizer.state_dict()``'s own format: parameters numbered in the
    order of ``names`` (the parameter names, group after group, as the optimizer was built),
    exactly what one process training the unsharded model would save."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=_options(True))
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(names)}
    unknown = set(by_name["state"]) - set(index)
    if unknown:
        raise RuntimeError(f"optimizer state for parameters it was not built with: {unknown}")
    groups = [
        {**group, "params": [index[name] for name in group["params"]]}
        for group in by_name["param_groups"]
    ]
    return {"state": {index[k]: v for k, v in by_name["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], names: list[str]
) -> None:
    """The inverse of :func:`full_optimizer_state`: a numbered state dict (as one process saves
    it), given on every rank, is sharded into ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    groups = [
        {**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]
    ]
    by_name = {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=_options(False))


def wrap_model(
    model: nn.Module, env, strategy: str, device: str = "auto"
) -> tuple[nn.Module, nn.Module]:
    """(what the training forward runs, the plain model), moved where ``device``
    (``train.device``) says (:func:`~attnkit.training.config.resolve_device`). The model itself
    twice for one process; under torchrun DistributedDataParallel around it, or the model
    sharded in place by FSDP2 with a full copy made before sharding as the plain model."""
    rank = env.local_rank if env.enabled else None
    model.to(resolve_device(device, next(model.parameters()).device, rank))
    if not env.enabled:
        return model, model
    device_ids = [env.local_rank] if torch.cuda.is_available() else None
    if strategy == "fsdp":
        plain = copy.deepcopy(model)  # the plain copy (before the shards replace it)
        for param in plain.parameters():
            param.requires_grad_(False)
        return shard_model(model), plain
    # Every parameter gets a gradient each step (in training, even a mixture-of-experts
    # expert that no token chose runs, on no rows), so DDP need not look for unused ones.
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids), model


@contextlib.contextmanager
def gradient_sync(train_model: nn.Module, sync: bool, sharded: bool):
    """A context in which backward all-reduces (DDP) / reduce-scatters (FSDP2) the gradients
    only if ``sync``: micro-batches before the last one just accumulate locally."""
    if sync:
        yield
    elif sharded:
        train_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            train_model.set_requires_gradient_sync(True)
    else:
        with train_model.no_sync():
            yield


def global_loss(
    loss_sum: float, count: int, stop: bool, device: torch.device
) -> tuple[float, int, bool]:
    """One all-reduce of (tokens, summed loss, stop flag) over the ranks: returns the global
    mean loss, the global token count, and whether any rank was asked to stop."""
    reduced = torch.tensor(
        [float(count), loss_sum, float(stop)], dtype=torch.float64, device=device
    )
    torch.distributed.all_reduce(reduced)
    total, weighted, stopped = reduced.tolist()
    return weighted / max(total, 1.0), int(total), bool(stopped)

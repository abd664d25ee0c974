"""What ``train.watch`` records at each evaluation of a language model: every head's detector
scores, measured on random tokens repeated, and the in-context-learning score of validation
texts (:mod:`attnkit.explain.circuits`); ``attnkit explain circuits RUN_DIR`` reads them back."""

from __future__ import annotations

import torch
from torch import nn

from attnkit.training.config import TrainConfig

__all__ = ["check_watch", "watched"]


def check_watch(task, names: list[str]) -> None:
    """A ValueError (one line) when ``names`` are asked of a task that is not a language model."""
    if names and not hasattr(task, "eval_batches"):
        raise ValueError(
            f"train.watch: head scores are recorded for language models (task 'lm'), not "
            f"task {task.name!r}"
        )


def watched(model: nn.Module, task, config: TrainConfig, device) -> dict:
    """``{"heads": {name: {"layer.head": score}}, "in_context": float}`` for ``config.watch``,
    over 4 validation batches ({} when it asks for nothing); the model is left in the mode it
    was in."""
    from attnkit.explain.circuits import in_context_score, watch_heads

    if not config.watch:
        return {}
    batches = task.eval_batches("validation", config.batch_size, 4)
    texts = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]).to(device)
    was_training = model.training
    model.eval()
    try:
        heads = watch_heads(model, config.watch, texts.shape[1] - 1)
        return {"heads": heads, "in_context": round(in_context_score(model, texts), 4)}
    finally:
        model.train(was_training)

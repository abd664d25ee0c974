"""attnkit.training: one loop for every task, with exact resume.

- :mod:`~attnkit.training.losses`: label-smoothed cross entropy over real tokens.
- :mod:`~attnkit.training.schedules`: the paper's warm-up schedule (noam), cosine, constant.
- :mod:`~attnkit.training.tasks`: ``Task`` (what the loop needs from a kind of training),
  ``LanguageModelTask`` and ``ExampleTask``; ``translation.TranslationTask`` and
  ``classification.ClassificationTask`` build on the latter.
- :mod:`~attnkit.training.checkpoint`: checkpoint directories (a model directory plus the
  optimizer and trainer state, no pickle, written atomically).
- :mod:`~attnkit.training.metrics`: ``metrics.jsonl`` and the loss-curve PNG.
- :mod:`~attnkit.training.trainer`: ``TrainConfig``, ``Trainer``.
- :mod:`~attnkit.training.distributed`: data-parallel training under torchrun (DDP).
- :mod:`~attnkit.training.recipes`: TOML recipes with typed ``--set`` overrides.
"""

from attnkit.training.checkpoint import (
    CheckpointError,
    TrainerState,
    find_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
)
from attnkit.training.losses import label_smoothed_cross_entropy, smoothed_targets
from attnkit.training.metrics import MetricsLog, plot_loss_curve
from attnkit.training.recipes import (
    DataConfig,
    Recipe,
    RecipeError,
    build_model,
    build_task,
    load_recipe,
)
from attnkit.training.schedules import constant_lr, cosine_lr, make_schedule, noam_lr
from attnkit.training.tasks import ExampleTask, LanguageModelTask, Task
from attnkit.training.trainer import TrainConfig, Trainer, TrainingDiverged, TrainResult

__all__ = [
    "CheckpointError",
    "DataConfig",
    "ExampleTask",
    "LanguageModelTask",
    "MetricsLog",
    "Recipe",
    "RecipeError",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainerState",
    "TrainingDiverged",
    "build_model",
    "build_task",
    "constant_lr",
    "cosine_lr",
    "find_checkpoint",
    "label_smoothed_cross_entropy",
    "load_checkpoint",
    "load_recipe",
    "make_schedule",
    "noam_lr",
    "plot_loss_curve",
    "read_trainer_state",
    "save_checkpoint",
    "smoothed_targets",
]

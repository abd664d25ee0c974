"""What a model's ``return_attention=True`` hands back, and how to take one example out of it.

attnkit models return, per the public API, a list with one (B, H, N, M) tensor per layer, or for
the encoder-decoder ``Transformer`` a dict ``{"encoder": [...], "decoder": [...], "cross":
[...]}`` of such lists. The pictures and reports show one example of the batch at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["ENCODER_DECODER_KEYS", "select_example"]

ENCODER_DECODER_KEYS = ("encoder", "decoder", "cross")


def _select_layers(layers, index: int, owner: str, name: str) -> list[Tensor]:
    """Example ``index`` of each (B, H, N, M) layer tensor: a list of (H, N, M) tensors."""
    if isinstance(layers, Tensor) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise TypeError(
            f"{owner}: {name} must be a non-empty list with one (B, H, N, M) tensor per layer, "
            f"got {type(layers).__name__}"
        )
    batch = None
    selected = []
    for layer, t in enumerate(layers):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{owner}: {name}[{layer}] must be a (B, H, N, M) tensor, got {got}")
        if batch is not None and t.shape[0] != batch:
            raise ValueError(
                f"{owner}: {name}[{layer}] has batch size {t.shape[0]}, but layer 0 has {batch}"
            )
        batch = t.shape[0]
        selected.append(t.detach().to("cpu", torch.float32))
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < batch:
        raise ValueError(f"{owner}: index must be an int in [0, {batch}), got {index!r}")
    return [t[index] for t in selected]  # each (H, N, M)


def select_example(attentions, index: int = 0, owner: str = "select_example"):
    """One batch element of a model's attentions.

    A list of (B, H, N, M) tensors gives a list of (H, N, M) tensors; a dict with some of the
    keys "encoder", "decoder", "cross" gives a dict of such lists (keys kept in that order).
    Tensors are detached, moved to the CPU and made float32.
    """
    if isinstance(attentions, Mapping):
        unknown = [k for k in attentions if k not in ENCODER_DECODER_KEYS]
        if unknown or not attentions:
            raise ValueError(
                f"{owner}: an encoder-decoder attentions dict must have keys among "
                f"{list(ENCODER_DECODER_KEYS)}, got {list(attentions)}"
            )
        return {
            key: _select_layers(attentions[key], index, owner, f"attentions[{key!r}]")
            for key in ENCODER_DECODER_KEYS
            if key in attentions
        }
    return _select_layers(attentions, index, owner, "attentions")

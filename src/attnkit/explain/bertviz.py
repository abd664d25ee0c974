"""attnkit attentions in the shape bertviz (jessevig/bertviz) expects, and as a JSON file.

bertviz's ``head_view`` and ``model_view`` take, like Hugging Face's ``output_attentions``,
one tensor per layer of shape ``(batch_size (must be 1), num_heads, N, M)``::

    from bertviz import head_view, model_view
    head_view(to_bertviz(attentions), tokens)                    # encoder-only / decoder-only
    model_view(**to_bertviz(enc_dec_attentions),                 # the encoder-decoder dict
               encoder_tokens=src_tokens, decoder_tokens=tgt_tokens)

attnkit models return a list of (B, H, N, M) tensors (``return_attention=True``), or for the
encoder-decoder a dict ``{"encoder", "decoder", "cross"}`` of such lists; ``to_bertviz`` picks
batch element ``index`` and renames the dict's keys to bertviz's keyword arguments
(``encoder_attention``, ``decoder_attention``, ``cross_attention``).

``export_bertviz_json`` writes the same data without needing bertviz (or a notebook): the list
bertviz builds internally and hands to its JavaScript (``attention`` in ``head_view.js``'s
parameters): one entry per attention, ``{"name", "attn": (L, H, N, M) nested lists,
"left_text": query tokens, "right_text": key tokens}``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from attnkit.explain._attentions import select_example
from attnkit.explain._checks import check_positive_int, check_tokens
from attnkit.files import atomic_write_text

__all__ = ["bertviz_data", "export_bertviz_json", "to_bertviz"]

# attnkit's encoder-decoder keys -> bertviz's keyword arguments and its names for them
_BERTVIZ_NAMES = {
    "encoder": ("encoder_attention", "Encoder"),
    "decoder": ("decoder_attention", "Decoder"),
    "cross": ("cross_attention", "Cross"),
}


def to_bertviz(attentions, *, index: int = 0) -> tuple[Tensor, ...] | dict[str, tuple[Tensor, ...]]:
    """One batch element of a model's attentions, in bertviz's layout.

    Args:
        attentions: a list with one (B, H, N, M) tensor per layer, or the encoder-decoder dict
            with some of the keys "encoder", "decoder", "cross".
        index: which batch element, 0 <= index < B.

    Returns:
        For a list: a tuple with one (1, H, N, M) float32 CPU tensor per layer (detached). For
        the dict: ``{"encoder_attention": ..., "decoder_attention": ..., "cross_attention":
        ...}`` with such tuples, for ``model_view(**result, encoder_tokens=...,
        decoder_tokens=...)`` (or ``head_view``).
    """
    example = select_example(attentions, index, "to_bertviz")
    if isinstance(example, list):
        return tuple(layer.unsqueeze(0).contiguous() for layer in example)  # each (1, H, N, M)
    return {
        _BERTVIZ_NAMES[key][0]: tuple(layer.unsqueeze(0).contiguous() for layer in layers)
        for key, layers in example.items()
    }


def _nested(layers: list[Tensor], decimals: int) -> list:
    """(L, H, N, M) nested lists of rounded floats."""
    return [
        [[[round(w, decimals) for w in row] for row in head] for head in layer.tolist()]
        for layer in layers
    ]


def bertviz_data(
    attentions,
    tokens: Sequence[str] | None = None,
    *,
    src_tokens: Sequence[str] | None = None,
    tgt_tokens: Sequence[str] | None = None,
    index: int = 0,
    decimals: int = 6,
) -> list[dict[str, Any]]:
    """bertviz's internal ``attn_data`` list for batch element ``index`` (plain Python data).

    A list of attentions needs ``tokens`` and gives one entry named None (bertviz's name for
    a plain self-attention model). The encoder-decoder dict needs ``src_tokens`` and
    ``tgt_tokens`` and gives "Encoder" (src x src), "Decoder" (tgt x tgt) and "Cross"
    (tgt queries, src keys), in that order.
    """
    owner = "bertviz_data"
    check_positive_int(owner, "decimals", decimals)
    example = select_example(attentions, index, owner)
    if isinstance(example, list):
        if tokens is None:
            raise ValueError(f"{owner}: tokens are required for a list of attentions")
        parts = [(None, example, tokens, tokens, "tokens", "tokens")]
    else:
        sides = {
            "encoder": (src_tokens, src_tokens, "src_tokens", "src_tokens"),
            "decoder": (tgt_tokens, tgt_tokens, "tgt_tokens", "tgt_tokens"),
            "cross": (tgt_tokens, src_tokens, "tgt_tokens", "src_tokens"),
        }
        parts = [(_BERTVIZ_NAMES[key][1], layers, *sides[key]) for key, layers in example.items()]
    data = []
    for name, layers, left, right, left_name, right_name in parts:
        _, n, m = layers[0].shape
        for what, value in ((left_name, left), (right_name, right)):
            if value is None:
                raise ValueError(f"{owner}: {what} are required for the {name} attention")
        left = check_tokens(left, owner, left_name, n, f"the {name or 'self'} attention has N={n}")
        right = check_tokens(
            right, owner, right_name, m, f"the {name or 'self'} attention has M={m}"
        )
        if not all(math.isfinite(w) for layer in layers for w in layer.reshape(-1).tolist()):
            raise ValueError(f"{owner}: the {name or 'self'} attention has NaN or inf weights")
        data.append(
            {
                "name": name,
                "attn": _nested(layers, decimals),
                "left_text": left,
                "right_text": right,
            }
        )
    return data


def export_bertviz_json(
    attentions,
    path: str | os.PathLike[str],
    tokens: Sequence[str] | None = None,
    *,
    src_tokens: Sequence[str] | None = None,
    tgt_tokens: Sequence[str] | None = None,
    index: int = 0,
    decimals: int = 6,
) -> Path:
    """Write :func:`bertviz_data` as JSON, ``{"attention": [...]}``, atomically; return the path.

    The file holds plain numbers and strings only (UTF-8, tokens as they are), so it loads
    anywhere: bertviz's JavaScript, a notebook, another tool.
    """
    data = bertviz_data(
        attentions,
        tokens,
        src_tokens=src_tokens,
        tgt_tokens=tgt_tokens,
        index=index,
        decimals=decimals,
    )
    text = json.dumps({"attention": data}, ensure_ascii=False, allow_nan=False)
    return atomic_write_text(path, text + "\n", "export_bertviz_json")

"""attnkit: the Transformer, whole and open to inspection.

The public API is listed in ``__all__``; docs/ARCHITECTURE.md maps the package: the layers, the
arrows between them, where each concept lives and where the speed levers plug in.
"""

from attnkit.attention import MultiHeadAttention, scaled_dot_product_attention
from attnkit.caches import KVCache
from attnkit.config import ModelConfig
from attnkit.interop.pretrained import export, from_pretrained
from attnkit.layers import DecoderLayer, EncoderLayer, FeedForward, count_parameters
from attnkit.masks import causal_mask, padding_mask
from attnkit.models import DecoderLM, EncoderClassifier, EncoderModel, Transformer, shift_right
from attnkit.position import (
    ALiBi,
    LearnedPositions,
    RotaryEmbedding,
    SinusoidalPositions,
    alibi_slopes,
    positions_from_mask,
    sinusoidal_table,
)
from attnkit.stacks import DecoderCache

__version__ = "0.1.0"

__all__ = [
    "ALiBi",
    "DecoderCache",
    "DecoderLM",
    "DecoderLayer",
    "EncoderClassifier",
    "EncoderLayer",
    "EncoderModel",
    "FeedForward",
    "KVCache",
    "LearnedPositions",
    "ModelConfig",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositions",
    "Transformer",
    "__version__",
    "alibi_slopes",
    "causal_mask",
    "count_parameters",
    "export",
    "from_pretrained",
    "padding_mask",
    "positions_from_mask",
    "scaled_dot_product_attention",
    "shift_right",
    "sinusoidal_table",
]

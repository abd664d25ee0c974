"""attnkit: the Transformer, whole and open to inspection.

The public API is listed in ``__all__``; see ../shared/DESIGN.md for the contract.
"""

from attnkit.attention import (
    KVCache,
    MultiHeadAttention,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
)
from attnkit.config import ModelConfig
from attnkit.interop.pretrained import from_pretrained
from attnkit.layers import DecoderLayer, EncoderLayer, FeedForward, count_parameters
from attnkit.models import (
    DecoderCache,
    DecoderLM,
    EncoderClassifier,
    EncoderModel,
    Transformer,
    shift_right,
)
from attnkit.position import (
    ALiBi,
    LearnedPositions,
    RotaryEmbedding,
    SinusoidalPositions,
    alibi_slopes,
    positions_from_mask,
    sinusoidal_table,
)

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
    "from_pretrained",
    "padding_mask",
    "positions_from_mask",
    "scaled_dot_product_attention",
    "shift_right",
    "sinusoidal_table",
]

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
    "KVCache",
    "LearnedPositions",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositions",
    "__version__",
    "alibi_slopes",
    "causal_mask",
    "padding_mask",
    "positions_from_mask",
    "scaled_dot_product_attention",
    "sinusoidal_table",
]

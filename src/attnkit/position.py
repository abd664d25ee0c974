"""Positions: attention itself is blind to order, so the model must be told where each token is.

Four ways, all keyed by integer position ids (B, N) so that left-padded batches and cached
decoding see the right positions:

- ``SinusoidalPositions``: the paper's fixed table (section 3.5), added to the embeddings.
- ``LearnedPositions``: a trained table (BERT, GPT-2), added to the embeddings.
- ``RotaryEmbedding``: RoPE (Su et al., 2021) rotates q and k inside attention, so that q.k
  depends only on the offset between the two positions (Llama).
- ``ALiBi``: (Press et al., 2022) adds ``-slope_h * |i - j|`` to the scores of head h.

``positions_from_mask`` turns a padding mask into position ids that count from each sequence's
first real token, so that left padding does not shift anyone's positions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnkit import checks

__all__ = [
    "ALiBi",
    "LearnedPositions",
    "RotaryEmbedding",
    "SinusoidalPositions",
    "alibi_slopes",
    "positions_from_mask",
    "rope_factors",
    "rope_frequencies",
    "sinusoidal_table",
]


def _check_positions(owner: str, positions: Tensor, max_len: int | None = None) -> None:
    if not isinstance(positions, Tensor):
        raise TypeError(f"{owner}: positions must be a tensor, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(f"{owner}: positions must be integer ids, got dtype {positions.dtype}")
    # Compiled decoding: generate checked the positions first, and reading them here would
    # split the compiled graph in two.
    if max_len is None or positions.numel() == 0 or checks.tracing():
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0:
        raise ValueError(f"{owner}: positions must be >= 0, got {low}")
    if max_len is not None and high >= max_len:
        raise ValueError(
            f"{owner}: position {high} is out of range: this model has max_len={max_len} "
            f"positions (0 .. {max_len - 1}); shorten the sequence or raise max_len"
        )


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids (B, N) from a (B, N) bool mask, True on real tokens.

    Each real token gets its index among the real tokens of its row (0, 1, 2, ...), so a row
    padded on the left numbers its first real token 0, exactly as if it stood alone. Padding
    positions get 0 (their outputs are never used).
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must have shape (B, N), got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.long()
    return ((mask.cumsum(dim=-1) - 1) * mask).clamp(min=0)  # (B, N)


# --------------------------------------------------------------------------------------------
# Added to the embeddings
# --------------------------------------------------------------------------------------------


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    r"""The paper's fixed positional encoding (section 3.5), a (max_len, d_model) table::

        PE(pos, 2i)     = sin(pos / 10000^(2i / d_model))
        PE(pos, 2i + 1) = cos(pos / 10000^(2i / d_model))

    Each pair of dimensions is a sinusoid of its own wavelength, from 2*pi up to 10000 * 2*pi,
    so PE(pos + k) is a fixed linear function (a rotation) of PE(pos) for every offset k.
    """
    checks.positive_int("sinusoidal_table: max_len", max_len)
    checks.positive_int("sinusoidal_table: d_model", d_model)
    if d_model % 2:
        raise ValueError(f"sinusoidal_table: d_model must be even (sin/cos pairs), got {d_model}")
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model / 2,)
    angle = pos / (10000.0 ** (two_i / d_model))  # (max_len, d_model / 2)
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class SinusoidalPositions(nn.Module):
    """The fixed sinusoidal table as a module: ``forward(positions) -> (B, N, d_model)``."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        self.max_len, self.d_model = max_len, d_model
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def reset_buffers(self) -> None:
        """Compute the table again (a model built on the meta device, then loaded)."""
        self.table = sinusoidal_table(self.max_len, self.d_model)

    def forward(self, positions: Tensor) -> Tensor:
        _check_positions("SinusoidalPositions", positions, self.max_len)
        return self.table[positions]  # (B, N, d_model)


class LearnedPositions(nn.Module):
    """A trained table of absolute positions (BERT, GPT-2): ``forward(positions) -> (B, N, D)``."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        checks.positive_int("LearnedPositions: max_len", max_len)
        checks.positive_int("LearnedPositions: d_model", d_model)
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)

    def forward(self, positions: Tensor) -> Tensor:
        _check_positions("LearnedPositions", positions, self.max_len)
        return self.embedding(positions)  # (B, N, d_model)


# --------------------------------------------------------------------------------------------
# Applied inside attention
# --------------------------------------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    r"""RoPE: rotate each pair of q (and k) dimensions by an angle proportional to the position.

    With inverse frequencies ``theta_i = base^(-2i / d)`` for i < d/2, the vector at position p
    is rotated, pair by pair, by the angles ``p * theta_i``::

        rope(x, p) = x * cos(p theta) + rotate_half(x) * sin(p theta)

    where ``rotate_half([x1, x2]) = [-x2, x1]`` pairs dimension i with dimension i + d/2 (the
    Hugging Face / Llama layout). Rotations compose, so
    ``rope(q, m) . rope(k, n) = q . R(n - m) k``: the score depends only on the offset n - m.

    ``dim`` may be less than the heads' width (Phi-3's partial rotary): the first ``dim``
    dimensions of each head turn, the rest pass through. ``scaling`` stretches the long
    wavelengths for contexts longer than training's (:func:`rope_frequencies`).
    """

    def __init__(self, dim: int, *, base: float = 10000.0, scaling: dict | None = None) -> None:
        super().__init__()
        checks.positive_int("RotaryEmbedding: dim", dim)
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even, got {dim}")
        if not base > 1.0:
            raise ValueError(f"RotaryEmbedding: base (rope_theta) must be > 1, got {base!r}")
        self.dim = dim
        self.base = float(base)
        self.scaling = scaling
        self.register_buffer("inv_freq", None, persistent=False)  # (d / 2,)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Compute the frequencies (again, for a model built on the meta device, then loaded)."""
        self.inv_freq = rope_frequencies(self.dim, self.base, self.scaling)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of the rotation angles, each (B, 1, N, d) for positions (B, N)."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # (B, N, d / 2)
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # (B, 1, N, d)
        return angles.cos(), angles.sin()

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x (B, H, N, d) by positions (B, N) or (N,)."""
        return self.rotate(x, positions=positions)[0]

    def rotate(self, *xs: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """Rotate each of xs (B, H, N, d), q and k for instance, by the same positions (B, N)
        or (N,): the angles' cos and sin are computed once for all of them."""
        for x in xs:
            if x.shape[-1] < self.dim:
                raise ValueError(
                    f"RotaryEmbedding: expected last dimension >= {self.dim}, got {tuple(x.shape)}"
                )
        _check_positions("RotaryEmbedding", positions)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)  # (1, N)
        cos, sin = self.cos_sin(positions)
        return tuple(_rotated(x, cos, sin) for x in xs)


def _rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, in float32 at least (cos and sin are float32)."""
    if x.dtype in (torch.float16, torch.bfloat16):  # rotate in float32, then back
        return _rotated(x.float(), cos, sin).to(x.dtype)
    d = cos.shape[-1]
    if x.shape[-1] > d:  # partial rotary: the rest of each head passes through
        return torch.cat([_rotated(x[..., :d], cos, sin), x[..., d:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin  # rotate_half(x) = [-x2, x1]


def rope_frequencies(dim: int, base: float, scaling: dict | None = None) -> Tensor:
    """RoPE's inverse frequencies ``theta_i = base^(-2i / d)``, i < d/2, each divided by the
    factor ``scaling`` gives it (:func:`rope_factors`)."""
    steps = torch.arange(0, dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / (base ** (steps / dim))  # (d / 2,)
    return inv_freq if scaling is None else inv_freq / rope_factors(inv_freq, scaling)


def rope_factors(inv_freq: Tensor, scaling: dict) -> Tensor:
    """What each of RoPE's frequencies is divided by (``ModelConfig.rope_scaling``, one of
    config.ROPE_SCALINGS), float32 (d / 2,):

    - ``linear``: ``factor`` for all (position interpolation);
    - ``llama3`` (Llama 3.1, 3.2): wavelengths ``2 pi / theta`` longer than the original
      context ``L / low_freq_factor`` by ``factor``, those shorter than ``L / high_freq_factor``
      by 1, and between them ``1 / ((1 - s) / factor + s)``, ``s = (L / wavelength - low) /
      (high - low)``, computed in float32 as llama.cpp's converter computes a GGUF file's
      ``rope_freqs``;
    - ``frequencies``: the list of factors itself (a GGUF file's ``rope_freqs``).
    """
    kind = scaling["rope_type"]
    if kind == "linear":
        return torch.full_like(inv_freq, float(scaling["factor"]))
    if kind == "frequencies":
        return torch.tensor(scaling["factors"], dtype=torch.float32)
    factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    s = (context / wavelength - low) / (high - low)
    between = 1 / ((1 - s) / factor + s)
    long = torch.where(wavelength > context / low, torch.full_like(s, factor), between)
    return torch.where(wavelength < context / high, torch.ones_like(s), long)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's per-head slopes: a geometric sequence starting at and multiplying by 2^(-8/n).

    For 8 heads: 1/2, 1/4, ..., 1/256. When n is not a power of two, the paper takes the slopes
    of the nearest lower power of two and fills in every other slope of twice that many.
    """
    checks.positive_int("alibi_slopes: n_heads", n_heads)

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        lower = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(lower) + power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(nn.Module):
    r"""Attention with Linear Biases: no position embeddings; head h adds to its scores::

        bias_h(i, j) = -slope_h * |pos_i - pos_j|

    Under a causal mask only j <= i is visible, where this is ``-slope_h * (i - j)``, the
    paper's form; the absolute value also serves bidirectional (encoder) attention.
    """

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)  # (H,)

    def reset_buffers(self) -> None:
        """Compute the slopes again (a model built on the meta device, then loaded)."""
        self.slopes = alibi_slopes(self.n_heads)

    def bias(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """The additive bias (B, H, N, M) for positions (B, N) and (B, M)."""
        _check_positions("ALiBi", query_positions)
        _check_positions("ALiBi", key_positions)
        if query_positions.dim() == 1:
            query_positions = query_positions.unsqueeze(0)
        if key_positions.dim() == 1:
            key_positions = key_positions.unsqueeze(0)
        distance = (query_positions[:, :, None] - key_positions[:, None, :]).abs()  # (B, N, M)
        return -self.slopes[None, :, None, None] * distance[:, None].float()  # (B, H, N, M)

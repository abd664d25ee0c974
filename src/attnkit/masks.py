"""The masks attention needs. **True means "may attend"** everywhere in attnkit, as in
``torch.nn.functional.scaled_dot_product_attention``.

- ``causal_mask``: the look-ahead mask of the decoder (query i sees keys j <= i).
- ``padding_mask``: which keys are real tokens, not padding.
- ``window_mask``: the band of sliding-window (local) attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import checks

__all__ = ["causal_mask", "combine", "padding_mask", "window_mask"]


def causal_mask(
    n: int, m: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """The look-ahead mask: query i may see key j only if j is not in its future.

    Returns a bool tensor of shape (n, m), True where ``j <= i + (m - n)``. With ``m == n`` this
    is the lower triangle (the diagonal included). With ``m > n`` the n queries are taken to be
    the *last* n of the m positions (bottom-right alignment), which is what a decoder that has
    already cached ``m - n`` keys needs. With ``m < n`` the first ``n - m`` queries see nothing.

    >>> causal_mask(3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """
    m = n if m is None else m
    for name, value in (("n", n), ("m", m)):
        checks.positive_int(f"causal_mask: {name}", value, minimum=0)
    i = torch.arange(n, device=device).unsqueeze(1)  # (n, 1)
    j = torch.arange(m, device=device).unsqueeze(0)  # (1, m)
    return j <= i + (m - n)


def padding_mask(input_ids: Tensor, pad_id: int) -> Tensor:
    """Which keys are real tokens: a bool tensor (B, 1, 1, M), True on real tokens.

    The two singleton axes let it broadcast against attention scores of shape (B, H, N, M):
    every head and every query ignores the same padded keys.
    """
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"padding_mask: input_ids must be a tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(
            f"padding_mask: input_ids must have shape (B, M), got {tuple(input_ids.shape)}"
        )
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"padding_mask: input_ids must be integer token ids, got {input_ids.dtype}")
    return (input_ids != pad_id)[:, None, None, :]  # (B, 1, 1, M)


def window_mask(
    n: int, m: int | None = None, *, window: int, causal: bool = True, device=None
) -> Tensor:
    """Bool (n, m), True where query i may see key j: ``0 <= d < window`` (causal) or
    ``|d| < window`` (bidirectional), d = i + (m - n) - j (queries are the last n of m, as in
    ``causal_mask``)."""
    m = n if m is None else m
    checks.positive_int("window", window)
    i = torch.arange(n, device=device).unsqueeze(1) + (m - n)  # (n, 1) absolute positions
    d = i - torch.arange(m, device=device).unsqueeze(0)  # (n, m)
    return (d >= 0) & (d < window) if causal else d.abs() < window


def combine(mask: Tensor | None, other: Tensor | None) -> Tensor | None:
    """Both masks at once: bool & bool stays bool; with an additive float mask, the blocked
    entries of a bool mask become -inf and two float masks add."""
    if mask is None or other is None:
        return other if mask is None else mask
    if mask.dtype == torch.bool and other.dtype == torch.bool:
        return mask & other
    if mask.dtype == torch.bool:
        mask, other = other, mask
    if other.dtype == torch.bool:
        return mask.masked_fill(~other, float("-inf"))
    return mask + other

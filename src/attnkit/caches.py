"""What attention remembers between decoding steps, behind one protocol.

A decoder that generates one token at a time would recompute the keys and values of every
earlier token at each step. A cache keeps them instead. Every cache here has

- ``update(keys) -> keys``: store this step's keys and values and return what the step attends
  over;
- ``reorder(index)``: keep batch rows ``index`` (beam search reorders its hypotheses);
- ``length``: how many positions it has seen.

``KVCache`` (full attention) keeps every position; ``RollingKVCache`` (sliding-window attention)
keeps the last ``window``; ``backends.LinearAttentionState`` (linear attention) keeps two running
sums whose size does not depend on the length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attnkit import checks

__all__ = ["KVCache", "Keys", "RollingKVCache"]


@dataclass
class Keys:
    """The keys and values one attention call attends over, and what backends need of them."""

    k: Tensor  # (B, H_kv, M, d_k)
    v: Tensor  # (B, H_kv, M, d_v)
    positions: Tensor | None = None  # (B, M) absolute positions (ALiBi); None if not needed
    valid: Tensor | None = None  # (B, M) True on real tokens (window and linear attention)
    past: tuple[Tensor, Tensor] | None = None  # linear attention: sums over earlier keys

    def repeat(self, groups: int) -> Keys:
        """Grouped-query attention: each key/value head serves ``groups`` query heads,
        (B, H_kv, M, d) -> (B, H_kv * groups, M, d)."""
        if groups == 1:
            return self
        past = None if self.past is None else tuple(_repeat(t, groups) for t in self.past)
        return replace(self, k=_repeat(self.k, groups), v=_repeat(self.v, groups), past=past)


def _repeat(t: Tensor, groups: int) -> Tensor:
    return t.repeat_interleave(groups, dim=1)


class KVCache:
    """Preallocated keys and values for one attention layer (incremental decoding).

    Storage is allocated once, (B, H_kv, max_len, d_head), and each step writes its new keys and
    values in place at ``[length, length + T)``: no ``torch.cat`` per step, so a decoding step
    costs the same memory traffic however long the cache already is.

    Self-attention appends each step's keys and values (after RoPE) and attends over all of
    them. Cross-attention fills the cache once with the source's keys and values and reuses
    them while ``length > 0``. ``positions`` (B, max_len) keeps each key's position, for ALiBi.
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("d_head", d_head),
        ):
            checks.positive_int(f"KVCache: {name}", value)
        shape = (batch_size, n_kv_heads, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, keys: Keys) -> Keys:
        """Store the new keys after the cached ones; attend over all of them."""
        k, v, positions = self.append(keys.k, keys.v, keys.positions)
        return Keys(k, v, positions if keys.positions is not None else None, keys.valid)

    def cached(self) -> Keys:
        """Everything stored so far (cross-attention reuses the source's keys and values)."""
        return Keys(self.k.narrow(2, 0, self.length), self.v.narrow(2, 0, self.length))

    def append(self, k: Tensor, v: Tensor, positions: Tensor | None = None):
        """Write k, v (B, H_kv, T, d_head) after the cached entries; return views of all of
        them: ``(k_all, v_all, positions_all)``, (B, H_kv, length, d_head) and (B, length)."""
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(
                f"KVCache.append: expected k and v of shape (B={self.k.shape[0]}, "
                f"H_kv={self.k.shape[1]}, T, d_head={self.k.shape[3]}), got {tuple(k.shape)} "
                f"and {tuple(v.shape)}"
            )
        start, t = self.length, k.shape[2]
        if start + t > self.max_len:
            raise ValueError(
                f"KVCache.append: the cache holds {self.max_len} positions; {start} are used "
                f"and {t} more do not fit"
            )
        self.k.narrow(2, start, t).copy_(k)  # narrow() + copy_(): one view, one copy
        self.v.narrow(2, start, t).copy_(v)
        if positions is not None:
            self.positions.narrow(1, start, t).copy_(positions)
        self.length = end = start + t
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end), self.positions.narrow(1, 0, end)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search reorders hypotheses each step)."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
        self.positions = self.positions.index_select(0, index)

    def written(self, count: int) -> None:
        """``count`` more positions were written in place into ``k``, ``v`` and ``positions``
        at ``[length, length + count)`` by a fused forward (``accel.PackedStack``'s C call)
        instead of :meth:`append`: they count as cached from now on."""
        if count < 0 or self.length + count > self.max_len:
            raise ValueError(
                f"KVCache.written: {count} more positions after {self.length} do not fit in "
                f"{self.max_len}"
            )
        self.length += count

    def ahead(self, count: int) -> None:
        """What :meth:`rewind` needs kept before ``count`` more positions are written: nothing
        (later positions never overwrite earlier ones)."""
        return None

    def rewind(self, count: int, saved: None = None) -> None:
        """Forget the last ``count`` positions (speculative decoding drops rejected drafts);
        later writes overwrite them."""
        if not 0 <= count <= self.length:
            raise ValueError(f"KVCache.rewind: count must be in [0, {self.length}], got {count}")
        self.length -= count


class RollingKVCache:
    """The last ``window`` keys and values of one layer, in a ring buffer of fixed size.

    Position p lives in slot ``p % window``; a decoding step overwrites the oldest entry, so
    memory and cost stay flat however long the generation runs. ``valid`` marks slots that
    hold a real token (not padding, not yet written); ``positions`` keeps each slot's position
    (ALiBi needs it; RoPE is already applied to the cached keys).
    """

    def __init__(self, batch_size, n_kv_heads, window, d_head, *, dtype=torch.float32, device=None):
        shape = (batch_size, n_kv_heads, window, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(batch_size, window, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, window, dtype=torch.bool, device=device)
        self.window = window
        self.length = 0  # positions seen so far

    def update(self, keys: Keys) -> Keys:
        """The prompt (an empty cache) attends over its own keys, whose last ``window`` are
        kept; a later step (one position) is written into the ring and attends over all of it."""
        b, _, t, _ = keys.k.shape
        if self.length and t != 1:
            raise ValueError(
                f"window attention with a filled cache decodes one position at a time, got {t}"
            )
        valid = keys.valid
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=keys.k.device)
        prompt = self.length == 0
        keep = min(t, self.window)
        slots = torch.arange(self.length + t - keep, self.length + t, device=self.k.device)
        slots = slots % self.window
        self.k[:, :, slots] = keys.k[:, :, t - keep :]
        self.v[:, :, slots] = keys.v[:, :, t - keep :]
        self.valid[:, slots] = valid[:, t - keep :]
        if keys.positions is not None:
            self.positions[:, slots] = keys.positions.expand(b, t)[:, t - keep :]
        self.length += t
        if prompt:
            return keys
        return Keys(self.k, self.v, self.positions, self.valid)

    def reorder(self, index: Tensor) -> None:
        for name in ("k", "v", "positions", "valid"):
            setattr(self, name, getattr(self, name).index_select(0, index))

    def written(self, count: int) -> None:
        """``count`` more positions were written in place into the ring's slots (``k``, ``v``,
        ``positions``, ``valid``) by a fused forward, as :meth:`KVCache.written`."""
        self.length += count

    def _slots(self, start: int, count: int) -> Tensor:
        return torch.arange(start, start + count, device=self.k.device) % self.window

    def ahead(self, count: int) -> tuple[Tensor, ...]:
        """A copy of the slots the next ``count`` positions will overwrite (at most ``window``),
        which :meth:`rewind` puts back."""
        if not 0 <= count <= self.window:
            raise ValueError(
                f"RollingKVCache.ahead: count must be in [0, {self.window}], got {count}"
            )
        slots = self._slots(self.length, count)
        return (
            self.k[:, :, slots],
            self.v[:, :, slots],
            self.positions[:, slots],
            self.valid[:, slots],
        )

    def rewind(self, count: int, saved: tuple[Tensor, ...]) -> None:
        """Forget the last ``count`` positions of those written since :meth:`ahead` kept their
        slots (``saved``): the slots get back what they held."""
        if not 0 <= count <= min(self.length, saved[0].shape[2]):
            raise ValueError(
                f"RollingKVCache.rewind: count must be in [0, {self.length}] and at most the "
                f"{saved[0].shape[2]} slots kept, got {count}"
            )
        written = saved[0].shape[2]  # the positions written since ahead(): all of those slots
        slots, first = self._slots(self.length - count, count), written - count
        k, v, positions, valid = saved
        self.k[:, :, slots], self.v[:, :, slots] = k[:, :, first:], v[:, :, first:]
        self.positions[:, slots], self.valid[:, slots] = positions[:, first:], valid[:, first:]
        self.length -= count

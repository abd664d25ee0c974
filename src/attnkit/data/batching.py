"""From token ids to training batches: padding, length bucketing, and packed LM blocks.

Three ways to turn examples into rectangles:

- :func:`pad_batch`: sequences of different lengths -> ids (B, N) and a bool mask (B, N), N the
  longest sequence. **True on real tokens** (attnkit's convention everywhere: True = may
  attend), False on padding. Right padding by default, left padding on request.
- :class:`BucketBatchSampler`: batches of indices whose sequences have similar lengths, so
  little of each batch is padding. For a ``torch.utils.data.DataLoader(batch_sampler=...)``.
- :class:`PackedBlocks`: for language models, a token stream cut into blocks of ``block_size``
  tokens; each gives ``x`` and ``y = x`` shifted by one (the next token at each position)::

      stream  t0 t1 t2 t3 t4 t5 t6 t7 t8 ...        block_size = 4
      block 0 x = t0 t1 t2 t3   y = t1 t2 t3 t4
      block 1 x = t4 t5 t6 t7   y = t5 t6 t7 t8

Everything random is a pure function of ``(seed, epoch)``: the order of epoch ``e`` does not
depend on what ran before, so a run that stopped at step ``s`` of epoch ``e`` resumes exactly by
asking for step ``s`` of epoch ``e`` again (no generator state to save).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

__all__ = ["BucketBatchSampler", "PackedBlocks", "concat_documents", "epoch_seed", "pad_batch"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed for epoch ``epoch`` of a run seeded ``seed``: SHA-1 of ``"seed:epoch"``.

    Neighbouring (seed, epoch) pairs give unrelated seeds, unlike ``seed + epoch``.
    """
    digest = hashlib.sha1(f"{int(seed)}:{int(epoch)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(epoch_seed(seed, epoch))


# --------------------------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------------------------


def pad_batch(
    sequences: Sequence[Sequence[int] | Tensor], pad_id: int, *, side: str = "right"
) -> tuple[Tensor, Tensor]:
    """Pad token sequences to the longest one: ids (B, N) long and mask (B, N) bool.

    ``mask`` is True on real tokens and False on padding (the model-level ``attention_mask``
    convention). ``side="left"`` puts the padding first, as generation from a batch of
    prompts wants.

    >>> ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=0)
    >>> ids.tolist(), mask.tolist()
    ([[5, 6, 7], [8, 0, 0]], [[True, True, True], [True, False, False]])
    """
    if side not in ("right", "left"):
        raise ValueError(f"pad_batch: side must be 'right' or 'left', got {side!r}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TypeError(f"pad_batch: pad_id must be an int, got {pad_id!r}")
    if isinstance(sequences, Tensor | str) or len(sequences) == 0:
        raise ValueError("pad_batch: sequences must be a non-empty list of token sequences")
    rows = []
    for i, seq in enumerate(sequences):
        try:
            row = torch.as_tensor(seq)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(
                f"pad_batch: sequences[{i}] is not a sequence of ints: {err}"
            ) from None
        if row.dim() == 1 and row.numel() == 0:
            row = row.long()  # [] arrives as float32
        if row.dim() != 1 or row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
            raise ValueError(
                f"pad_batch: sequences[{i}] must be a 1-D sequence of ints, got shape "
                f"{tuple(row.shape)} of {row.dtype}"
            )
        rows.append(row.long())
    n = max(len(row) for row in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)  # (B, N)
    mask = torch.zeros((len(rows), n), dtype=torch.bool)  # (B, N)
    for b, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(n - len(row), n)
        ids[b, span] = row
        mask[b, span] = True
    return ids, mask


# --------------------------------------------------------------------------------------------
# Length bucketing
# --------------------------------------------------------------------------------------------


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of indices with similar lengths; the order is a pure function of (seed, epoch).

    With ``shuffle=True`` (training), one epoch is:

    1. a random permutation of all indices (from ``seed`` and the epoch);
    2. cut into pools of ``batch_size * pool_batches`` indices, each pool sorted by length
       (ties keep the permuted order);
    3. the pools, laid end to end, cut into batches of ``batch_size`` (only the very last
       batch can be short; ``drop_last`` drops it);
    4. the batches in a random order (so lengths do not grow through the epoch).

    A pool is a local window: batches are nearly uniform in length, yet which examples meet in a
    batch changes every epoch. With ``shuffle=False`` (evaluation), the indices are sorted by
    length over the whole dataset and batched in that order, the same every time.

    Call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``), or ask for
    :meth:`batches` of any epoch directly.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        pool_batches: int = 50,
    ) -> None:
        self.lengths = [int(n) for n in lengths]
        if not self.lengths:
            raise ValueError("BucketBatchSampler: lengths is empty; expected one per example")
        if min(self.lengths) < 0:
            raise ValueError(f"BucketBatchSampler: lengths must be >= 0, got {min(self.lengths)}")
        self.batch_size = _check_int("BucketBatchSampler: batch_size", batch_size, 1)
        self.pool_batches = _check_int("BucketBatchSampler: pool_batches", pool_batches, 1)
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Which epoch ``iter(sampler)`` gives next."""
        self.epoch = _check_int("BucketBatchSampler.set_epoch: epoch", epoch, 0)

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch``, in order: a list of lists of dataset indices."""
        _check_int("BucketBatchSampler.batches: epoch", epoch, 0)
        n, size = len(self.lengths), self.batch_size
        if self.shuffle:
            generator = _generator(self.seed, epoch)
            order = torch.randperm(n, generator=generator).tolist()
            pool = size * self.pool_batches
            order = [
                i
                for start in range(0, n, pool)
                for i in sorted(order[start : start + pool], key=self.lengths.__getitem__)
            ]
        else:
            order = sorted(range(n), key=self.lengths.__getitem__)
        batches = [order[start : start + size] for start in range(0, n, size)]
        if self.drop_last and len(batches[-1]) < size:
            batches.pop()
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=generator)]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches(self.epoch))


# --------------------------------------------------------------------------------------------
# Packing for language models
# --------------------------------------------------------------------------------------------


def concat_documents(documents: Iterable[Sequence[int]], sep_id: int | None = None) -> Tensor:
    """One long stream of token ids from many documents, ``sep_id`` (e.g. EOS) after each.

    The stream that :class:`PackedBlocks` cuts into blocks; a separator lets the model learn
    where one document ends and the next begins.
    """
    pieces: list[Tensor] = []
    sep = None if sep_id is None else torch.tensor([sep_id], dtype=torch.long)
    for i, doc in enumerate(documents):
        ids = torch.as_tensor(doc).reshape(-1)
        if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
            raise TypeError(f"concat_documents: documents[{i}] must hold int ids, got {ids.dtype}")
        pieces.append(ids.long())
        if sep is not None:
            pieces.append(sep)
    if not pieces:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(pieces)


class PackedBlocks(Dataset[tuple[Tensor, Tensor]]):
    """A token stream cut into ``len(self)`` non-overlapping blocks of ``block_size`` tokens.

    ``self[i]`` is block i of the stream, ``(x, y)``, both (block_size,) long, ``y[t] = x[t+1]``
    (and the last ``y`` is the first token after the block). ``(len(tokens) - 1) // block_size``
    blocks fit; the few tokens left at the end are unused.

    For training, :meth:`block` and :meth:`batch` read an epoch's shuffled order, a pure
    function of ``(seed, epoch)``: block ``i`` of epoch ``e`` is the same in every process and
    after every restart (for a given torch version). Every block appears exactly once per epoch.
    Resuming at step ``s`` of epoch ``e`` is ``batch(e, s, batch_size)``, nothing else to save.
    """

    def __init__(
        self,
        tokens: Sequence[int] | Tensor,
        block_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.block_size = _check_int("PackedBlocks: block_size", block_size, 1)
        stream = torch.as_tensor(tokens).reshape(-1)
        if stream.is_floating_point() or stream.dtype == torch.bool:
            raise TypeError(f"PackedBlocks: tokens must be integer ids, got {stream.dtype}")
        self.tokens = stream.long()
        self.n_blocks = (len(self.tokens) - 1) // block_size
        if self.n_blocks < 1:
            raise ValueError(
                f"PackedBlocks: {len(self.tokens)} tokens make no block of block_size "
                f"{block_size}; need at least block_size + 1 = {block_size + 1}"
            )
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self._order_cache: tuple[int, Tensor] | None = None

    def __len__(self) -> int:
        return self.n_blocks

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        index = int(index)
        if not -self.n_blocks <= index < self.n_blocks:
            raise IndexError(f"PackedBlocks: block {index} out of range for {self.n_blocks} blocks")
        start = (index % self.n_blocks) * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]  # (block_size + 1,)
        return chunk[:-1], chunk[1:]

    def order(self, epoch: int) -> Tensor:
        """The block indices of ``epoch`` in the order they are served, (len(self),) long."""
        _check_int("PackedBlocks.order: epoch", epoch, 0)
        if not self.shuffle:
            return torch.arange(self.n_blocks)
        if self._order_cache is None or self._order_cache[0] != epoch:
            perm = torch.randperm(self.n_blocks, generator=_generator(self.seed, epoch))
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    def block(self, epoch: int, i: int) -> tuple[Tensor, Tensor]:
        """The ``i``-th block served in ``epoch``: ``self[order(epoch)[i]]``."""
        return self[int(self.order(epoch)[i])]

    def steps_per_epoch(self, batch_size: int) -> int:
        """Full batches in one epoch (the last, short one is left out so shapes stay fixed)."""
        return self.n_blocks // _check_int("PackedBlocks: batch_size", batch_size, 1)

    def batch(self, epoch: int, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """Batch ``step`` of ``epoch``: x and y, each (batch_size, block_size) long."""
        steps = self.steps_per_epoch(batch_size)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < steps:
            raise IndexError(
                f"PackedBlocks.batch: step must be in [0, {steps}) for batch_size {batch_size} "
                f"and {self.n_blocks} blocks, got {step!r}"
            )
        picked = self.order(epoch)[step * batch_size : (step + 1) * batch_size]  # (B,)
        starts = picked * self.block_size  # (B,)
        offsets = torch.arange(self.block_size + 1)  # (T + 1,)
        chunks = self.tokens[starts[:, None] + offsets[None, :]]  # (B, T + 1)
        return chunks[:, :-1], chunks[:, 1:]  # (B, T), (B, T)

    def batches(
        self, epoch: int, batch_size: int, start_step: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """The batches of ``epoch`` from ``start_step`` on (resume mid-epoch with it)."""
        for step in range(start_step, self.steps_per_epoch(batch_size)):
            yield self.batch(epoch, step, batch_size)

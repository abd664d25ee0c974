"""Batching: padding with a True-on-real-tokens mask, length buckets, packed LM blocks whose order
is a pure function of (seed, epoch) so training resumes exactly."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.data import (
    BucketBatchSampler,
    PackedBlocks,
    concat_documents,
    epoch_seed,
    pad_batch,
)

# --- pad_batch ------------------------------------------------------------------------------


def test_pad_batch_right():
    ids, mask = pad_batch([[5, 6, 7], [8], []], pad_id=0)
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]


def test_pad_batch_left_and_tensors():
    ids, mask = pad_batch([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=9, side="left")
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]


@given(st.lists(st.lists(st.integers(5, 100), max_size=12), min_size=1, max_size=6))
@settings(max_examples=50, deadline=None)
def test_pad_batch_property(seqs):
    ids, mask = pad_batch(seqs, pad_id=0)
    assert ids.shape == mask.shape == (len(seqs), max(len(s) for s in seqs))
    assert mask.sum(dim=1).tolist() == [len(s) for s in seqs]
    assert [ids[b][mask[b]].tolist() for b in range(len(seqs))] == seqs
    assert (ids[~mask] == 0).all()


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([],), {"pad_id": 0}, ValueError, "non-empty list"),
        (([[1]],), {"pad_id": 0, "side": "middle"}, ValueError, "side must be 'right' or 'left'"),
        (([[1]],), {"pad_id": 0.5}, TypeError, "pad_id must be an int, got 0.5"),
        (([[1], [[2]]],), {"pad_id": 0}, ValueError, r"sequences\[1\] must be a 1-D sequence"),
        (([[1.5]],), {"pad_id": 0}, ValueError, r"sequences\[0\] must be a 1-D sequence of ints"),
    ],
)
def test_pad_batch_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        pad_batch(*args, **kwargs)


# --- BucketBatchSampler ---------------------------------------------------------------------


def _lengths(n=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 200, (n,), generator=g).tolist()


def test_bucket_sampler_covers_every_index_once():
    lengths = _lengths()
    sampler = BucketBatchSampler(lengths, batch_size=32, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 32  # ceil(1000 / 32)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(1000))
    assert sum(len(b) < 32 for b in batches) == 1


def test_bucket_sampler_is_deterministic_per_seed_and_epoch():
    lengths = _lengths()
    a = BucketBatchSampler(lengths, batch_size=16, seed=7)
    b = BucketBatchSampler(lengths, batch_size=16, seed=7)
    assert a.batches(2) == b.batches(2)
    b.set_epoch(2)
    assert list(b) == a.batches(2)  # epoch 2 needs no history of epochs 0 and 1
    assert a.batches(0) != a.batches(1)
    assert a.batches(0) != BucketBatchSampler(lengths, batch_size=16, seed=8).batches(0)
    assert epoch_seed(7, 2) == epoch_seed(7, 2) != epoch_seed(7, 3)


def test_bucket_sampler_reduces_padding():
    lengths = _lengths(2000)
    size = 32

    def padding(batches):
        return sum(
            max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches
        )

    bucketed = padding(BucketBatchSampler(lengths, size, seed=0).batches(0))
    perm = torch.randperm(2000, generator=torch.Generator().manual_seed(0)).tolist()
    random_batches = [perm[i : i + size] for i in range(0, 2000, size)]
    assert bucketed < 0.2 * padding(random_batches)


def test_bucket_sampler_no_shuffle_sorts_by_length_and_drop_last():
    lengths = [5, 1, 4, 2, 3, 9, 7]
    sampler = BucketBatchSampler(lengths, batch_size=3, shuffle=False, drop_last=True)
    assert sampler.batches(0) == [[1, 3, 4], [2, 0, 6]]
    assert sampler.batches(5) == sampler.batches(0)
    assert len(sampler) == 2
    shuffled = BucketBatchSampler(lengths, batch_size=3, drop_last=True, seed=1)
    assert all(len(b) == 3 for b in shuffled.batches(0)) and len(shuffled.batches(0)) == 2


def test_bucket_sampler_works_with_a_dataloader():
    data = [list(range(n)) for n in _lengths(100)]
    sampler = BucketBatchSampler([len(d) for d in data], batch_size=8, seed=0)
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=sampler, collate_fn=lambda seqs: pad_batch(seqs, pad_id=0)
    )
    seen = 0
    for ids, mask in loader:
        assert ids.shape == mask.shape and ids.shape[0] <= 8
        seen += ids.shape[0]
    assert seen == 100


@pytest.mark.parametrize(
    ("lengths", "kwargs", "match"),
    [
        ([], {"batch_size": 2}, "lengths is empty"),
        ([1, -1], {"batch_size": 2}, "lengths must be >= 0, got -1"),
        ([1, 2], {"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ([1, 2], {"batch_size": 2, "pool_batches": 0}, "pool_batches must be an int >= 1"),
    ],
)
def test_bucket_sampler_errors(lengths, kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketBatchSampler(lengths, **kwargs)


# --- PackedBlocks ---------------------------------------------------------------------------


def test_packed_blocks_shift_by_one():
    blocks = PackedBlocks(list(range(10)), block_size=4, shuffle=False)
    assert len(blocks) == 2  # (10 - 1) // 4
    x, y = blocks[0]
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4]
    x, y = blocks[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    assert blocks.order(3).tolist() == [0, 1]
    x, y = blocks.batch(0, 0, batch_size=2)
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_packed_blocks_exact_fit():
    blocks = PackedBlocks(torch.arange(9), block_size=4)
    assert len(blocks) == 2
    assert blocks[-1][1].tolist() == [5, 6, 7, 8]


def test_packed_blocks_each_block_once_per_epoch():
    stream = torch.arange(1001)
    blocks = PackedBlocks(stream, block_size=10, seed=5)
    for epoch in (0, 1):
        order = blocks.order(epoch)
        assert sorted(order.tolist()) == list(range(100))
        firsts = sorted(int(blocks.block(epoch, i)[0][0]) for i in range(100))
        assert firsts == list(range(0, 1000, 10))
    assert blocks.order(0).tolist() != blocks.order(1).tolist()


def test_packed_blocks_are_a_pure_function_of_seed_epoch_index():
    stream = torch.randint(0, 50, (5000,), generator=torch.Generator().manual_seed(0))
    a = PackedBlocks(stream, block_size=16, seed=11)
    b = PackedBlocks(stream.tolist(), block_size=16, seed=11)
    b.order(0)  # a different history: b has already computed epoch 0
    for epoch, i in [(3, 0), (3, 17), (0, 5), (7, 300)]:
        xa, ya = a.block(epoch, i)
        xb, yb = b.block(epoch, i)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = PackedBlocks(stream, block_size=16, seed=12)
    assert not torch.equal(a.order(3), c.order(3))


def test_packed_blocks_resume_mid_epoch():
    stream = torch.arange(2000) % 97
    blocks = PackedBlocks(stream, block_size=8, seed=2)
    full = list(blocks.batches(epoch=1, batch_size=4))
    assert len(full) == blocks.steps_per_epoch(4) == 62  # 249 blocks // 4
    resumed = list(PackedBlocks(stream, block_size=8, seed=2).batches(1, 4, start_step=40))
    assert len(resumed) == 22
    for (x1, y1), (x2, y2) in zip(full[40:], resumed, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x, y = full[0]
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    order = blocks.order(1)[:4].tolist()
    assert torch.equal(x, torch.stack([blocks[i][0] for i in order]))


def test_packed_blocks_errors():
    with pytest.raises(ValueError, match="5 tokens make no block of block_size 8"):
        PackedBlocks([1, 2, 3, 4, 5], block_size=8)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        PackedBlocks([1, 2, 3], block_size=0)
    with pytest.raises(TypeError, match="tokens must be integer ids"):
        PackedBlocks(torch.rand(100), block_size=4)
    blocks = PackedBlocks(list(range(100)), block_size=4)
    with pytest.raises(IndexError, match="block 24 out of range for 24 blocks"):
        blocks[24]
    with pytest.raises(IndexError, match=r"step must be in \[0, 2\)"):
        blocks.batch(0, 2, batch_size=10)


def test_concat_documents():
    stream = concat_documents([[5, 6], [7], []], sep_id=2)
    assert stream.tolist() == [5, 6, 2, 7, 2, 2]
    assert concat_documents([[5, 6], [7]]).tolist() == [5, 6, 7]
    assert concat_documents([]).tolist() == []

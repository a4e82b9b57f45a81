import re
import zlib

import pytest
import torch

from dpddp.data import synthetic
from dpddp.data.global_batch import GlobalBatchSampler
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.data.rules import check_random_tensors
from dpddp.data.synthetic import BLOCK, StreamingTensors, checksum, make_tensors
from dpddp.errors import ConfigError


def test_tensors_are_a_pure_function_of_seed_and_sizes():
    torch.manual_seed(123)  # the global RNG must not matter
    a = make_tensors(7, 300, 5, 3, 0.1)
    torch.manual_seed(456)
    b = make_tensors(7, 300, 5, 3, 0.1)
    assert checksum(*a) == checksum(*b)
    assert checksum(*make_tensors(8, 300, 5, 3, 0.1)) != checksum(*a)
    x, y = a
    assert x.shape == (300, 5) and x.dtype == torch.float32
    assert y.shape == (300,) and y.dtype == torch.int64 and 0 <= y.min() and y.max() < 3


def test_checksum_of_a_large_tensor_reads_evenly_spaced_rows(monkeypatch):
    """Over ``CHECKSUM_BYTES`` a tensor counts by that many bytes of its rows, first and last included: the CRC of
    those rows, changed by a change in any of them; under it, by all its bytes."""
    monkeypatch.setattr(synthetic, "CHECKSUM_BYTES", 64)  # 4 rows of 4 float32
    x, y = make_tensors(0, 100, 4, 3)
    picked = x[[0, 33, 66, 99]]
    assert checksum(x) == f"{zlib.crc32(picked.numpy().tobytes()):08x}"
    assert checksum(x[:4]) == f"{zlib.crc32(x[:4].numpy().tobytes()):08x}"  # 64 bytes: all of it
    labels = y[[0, 14, 28, 42, 56, 70, 84, 99]]  # 8 rows of one int64
    assert checksum(x, y) == f"{zlib.crc32(labels.numpy().tobytes(), zlib.crc32(picked.numpy().tobytes())):08x}"
    for row in (0, 33, 99):
        changed = x.clone()
        changed[row, 2] += 1
        assert checksum(changed) != checksum(x), row
    assert checksum(make_tensors(1, 100, 4, 3)[0]) != checksum(x)


def test_label_noise_flips_about_that_fraction():
    clean = make_tensors(0, 20000, 8, 4)[1]
    noisy = make_tensors(0, 20000, 8, 4, label_noise=0.4)[1]
    # a flipped label lands on the clean class 1 time in 4
    assert abs((clean != noisy).float().mean().item() - 0.4 * 0.75) < 0.02


def _rank_batches(n, batch, world, train, epoch=0, block_size=None):
    out = []
    for rank in range(world):
        s = GlobalBatchSampler(n, batch, rank, world, train=train, seed=3, block_size=block_size)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("block_size", [None, 16], ids=["full shuffle", "block shuffle"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_global_batches_are_the_same_for_every_world_size(world, block_size):
    single = _rank_batches(1003, 8, 1, train=True, epoch=2, block_size=block_size)[0]
    ranks = _rank_batches(1003, 8, world, train=True, epoch=2, block_size=block_size)
    assert len(single) == 1003 // 8 and all(len(r) == len(single) for r in ranks)
    for step, batch in enumerate(single):
        assert torch.equal(torch.cat([r[step] for r in ranks]), batch)
        assert all(len(r[step]) == 8 // world for r in ranks)


def test_training_order_changes_with_epoch_and_seed():
    s = GlobalBatchSampler(100, 10, train=True, seed=1)
    first = torch.cat(list(s))
    s.set_epoch(1)
    assert not torch.equal(first, torch.cat(list(s)))
    assert sorted(first.tolist()) == list(range(100))


@pytest.mark.parametrize("n,batch,world", [(1005, 64, 2), (101, 63, 3), (129, 64, 2), (7, 4, 4)])
def test_evaluation_counts_every_sample_exactly_once(n, batch, world):
    ranks = _rank_batches(n, batch, world, train=False)
    assert len({len(r) for r in ranks}) == 1  # same number of batches on every rank: no hang
    seen = torch.cat([b for r in ranks for b in r])
    assert sorted(seen.tolist()) == list(range(n))


def test_batch_size_must_divide_by_world_size():
    with pytest.raises(ConfigError, match=r"^data.batch_size=10 \(global\) does not divide by the world size 4 "):
        GlobalBatchSampler(100, 10, rank=0, world_size=4)


def test_datamodule_splits_and_batches():
    dm = RandomTensorDataModule(num_samples=1000, num_features=6, num_classes=3, batch_size=32, val_fraction=0.15)
    dm.setup("fit")
    assert (dm.num_train, dm.num_val, dm.num_test) == (750, 150, 100)
    loader = dm.train_dataloader()
    assert len(loader) == 750 // 32
    x, y = next(iter(loader))
    assert x.shape == (32, 6) and y.shape == (32,)
    val = list(dm.val_dataloader())
    assert sum(len(b[1]) for b in val) == 150


def test_block_shuffle_visits_every_sample_once_and_changes_with_the_epoch():
    s = GlobalBatchSampler(1003, 8, train=True, seed=1, block_size=16)
    first = torch.cat(list(s))
    assert len(first) == 1003 // 8 * 8 and len(set(first.tolist())) == len(first)  # a permutation, drop-last
    assert first[:16].tolist() != list(range(16)) and set(first[-3:].tolist()) <= set(range(992, 1003))
    s.set_epoch(1)
    second = torch.cat(list(s))
    assert not torch.equal(first, second) and sorted(first.tolist()) == sorted(second.tolist())


def test_streaming_samples_depend_only_on_seed_and_id():
    """Same sample whatever the batch, the cache state, the split offset or num_samples; the teacher is the
    in-memory mode's (same task)."""
    ds = StreamingTensors(5, 6, 3, 0.0, offset=0, length=3 * BLOCK)
    ids = torch.tensor([3 * BLOCK - 1, 7, BLOCK + 2, 7])
    x, y = ds[ids]
    assert x.shape == (4, 6) and y.shape == (4,) and torch.equal(x[1], x[3])
    fresh = StreamingTensors(5, 6, 3, 0.0, offset=BLOCK, length=2 * BLOCK)
    fresh.cache_blocks = 1
    x2, y2 = fresh[torch.tensor([2, 2 * BLOCK - 1])]  # global ids BLOCK + 2 and 3 * BLOCK - 1
    assert torch.equal(x2, x[[2, 0]]) and torch.equal(y2, y[[2, 0]])
    assert not torch.equal(StreamingTensors(6, 6, 3, 0.0, 0, BLOCK)[ids[:1]][0], x[:1])
    mx, my = make_tensors(5, 10, 6, 3)
    teacher, bias = ds.teacher, ds.bias
    assert torch.equal((mx @ teacher + bias).argmax(1), my)  # the in-memory mode's teacher


def test_streaming_memory_does_not_grow_with_num_samples():
    """Ten billion samples (160 GB in memory; indices past 2**32): nothing is drawn up front, and a batch far into
    the stream is there. (The block order, 8 bytes a block, is drawn: 20 MB here, 2 GB and 20 s for a trillion.)"""
    dm = RandomTensorDataModule(num_samples=10**10, num_features=4, num_classes=2, batch_size=64, streaming=True)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert len(loader) == dm.num_train // 64
    x, y = next(iter(loader))
    assert x.shape == (64, 4) and y.shape == (64,)
    far = dm.splits["test"][torch.tensor([dm.num_test - 1])]
    assert far[0].shape == (1, 4)
    assert sum(len(b[0]) for b in dm.splits["train"]._cache.values()) <= 4 * BLOCK  # a few blocks cached, no more


def test_streaming_evaluation_is_the_split_in_order():
    dm = RandomTensorDataModule(num_samples=3 * BLOCK + 5, num_features=6, num_classes=3, batch_size=64, streaming=True)
    dm.setup("fit")
    seen = torch.cat([b[1] for b in dm.val_dataloader()])
    direct = dm.splits["val"][torch.arange(dm.num_val)][1]
    assert torch.equal(seen, direct)


def test_streaming_empty_chunk_of_a_short_last_batch():
    """Under ddp a rank's chunk of a last evaluation batch of 1 sample is empty (in-memory mode handles it too)."""
    ds = StreamingTensors(0, 6, 3, 0.0, offset=100, length=50)
    x, y = ds[torch.zeros(0, dtype=torch.long)]
    assert x.shape == (0, 6) and y.shape == (0,)
    dm = RandomTensorDataModule(num_samples=650, num_features=6, num_classes=3, batch_size=64, streaming=True)
    dm.setup("fit")
    ranks = [list(GlobalBatchSampler(dm.num_val, 64, r, 2)) for r in range(2)]
    assert sum(len(dm.splits["val"][b][1]) for r in ranks for b in r) == dm.num_val == 65


DATA = dict(num_samples=1001, num_features=3, num_classes=2, batch_size=8, val_fraction=0.15, test_fraction=0.05)
DATA.update(label_noise=0.0, seed=0, streaming=False)


def test_the_config_check_counts_the_splits_the_data_module_builds():
    """The check reads the split sizes from the settings alone (nothing built), by the module's own rule."""
    dm = RandomTensorDataModule(**DATA)
    dm.setup("fit")
    assert check_random_tensors(DATA, 1) == tuple(len(dm.splits[s]) for s in ("train", "val", "test")) == (801, 150, 50)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"batch_size": 0}, "data.batch_size=0 is invalid: use a positive global batch size"),
        ({"val_fraction": 0.95}, "data.val_fraction=0.95 is invalid: use a fraction in [0, 0.9]"),
        ({"val_fraction": 0.9, "test_fraction": 0.2}, "data.val_fraction=0.9 + data.test_fraction=0.2 leave no"),
        ({"batch_size": 802}, "data.batch_size=802 is larger than the train split (801 samples): lower"),
    ],
)
def test_the_data_module_refuses_at_setup_what_the_config_check_refuses(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_random_tensors({**DATA, **change}, 1)
    with pytest.raises(ConfigError, match=re.escape(message)):
        RandomTensorDataModule(**{**DATA, **change}).setup("fit")

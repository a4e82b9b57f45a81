import pytest
import torch

from dpddp.data import GlobalBatchSampler, RandomTensorDataModule, checksum, make_tensors


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


def test_label_noise_flips_about_that_fraction():
    clean = make_tensors(0, 20000, 8, 4)[1]
    noisy = make_tensors(0, 20000, 8, 4, label_noise=0.4)[1]
    # a flipped label lands on the clean class 1 time in 4
    assert abs((clean != noisy).float().mean().item() - 0.4 * 0.75) < 0.02


def _rank_batches(n, batch, world, train, epoch=0):
    out = []
    for rank in range(world):
        s = GlobalBatchSampler(n, batch, rank, world, train=train, seed=3)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_global_batches_are_the_same_for_every_world_size(world):
    single = _rank_batches(1003, 8, 1, train=True, epoch=2)[0]
    ranks = _rank_batches(1003, 8, world, train=True, epoch=2)
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
    with pytest.raises(ValueError, match=r"data.batch_size=10 .* world size 4"):
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

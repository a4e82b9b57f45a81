"""Exact streams (issue 52, case 62): an ``IterableDataset`` in global batches (``data=stream``,
``dpddp.data.streams``): every world size trains the next ``batch_size`` samples, a stream's own shuffle is the same
on every rank, a continue reads past what was trained, evaluation counts each sample once."""

from __future__ import annotations

import pytest
import torch
from conftest import QUIET, ROOT, compose_cfg, leftover, max_diff, metrics, run_train, weights
from users_models import ShuffledStream

from dpddp.data.streams import StreamDataModule, StreamShares
from dpddp.errors import ConfigError
from dpddp.run.training import train


def _batches(world_size: int, train: bool = True, position=None, rank_seed: int = 0) -> list[list[torch.Tensor]]:
    """Each rank's batches (``(x, y)``) of samples ``[10, 10 + 300)`` of a ``ShuffledStream``, global batch 12, the
    rank's own global stream seeded by ``rank_seed + rank`` (as dpddp's ranks' differ)."""
    ranks = []
    for rank in range(world_size):
        torch.manual_seed(rank_seed + rank)
        shares = StreamShares(ShuffledStream(), 10, 300, 12, rank, world_size, train, seed=5)
        shares.position = position
        before = torch.get_rng_state()
        ranks.append(list(shares))
        assert torch.equal(before, torch.get_rng_state())  # the stream drew from its own streams, not the rank's
    return ranks


def test_every_world_size_trains_the_next_global_batch_of_one_shuffle_and_a_continue_reads_past_it():
    (one,) = _batches(1)
    assert len(one) == 300 // 12 and all(len(y) == 12 for _, y in one)
    for world_size in (2, 3):
        ranks = _batches(world_size, rank_seed=100)
        for step, (x, y) in enumerate(one):
            assert torch.equal(torch.cat([r[step][0] for r in ranks]), x)
            assert torch.equal(torch.cat([r[step][1] for r in ranks]), y)
    (resumed,) = _batches(1, position=lambda: (0, 7))  # 7 batches trained: the next is the 8th
    assert len(resumed) == len(one) - 7 and all(torch.equal(a[0], b[0]) for a, b in zip(resumed, one[7:], strict=True))
    (epoch_1,) = _batches(1, position=lambda: (1, 0))
    assert not torch.equal(epoch_1[0][0], one[0][0])  # each epoch its own shuffle, keyed by (seed, epoch)


def test_evaluation_counts_each_sample_once_and_a_short_stream_is_one_line():
    (one,) = _batches(1, train=False)
    ranks = _batches(3, train=False)
    assert [len(y) for _, y in one] == [12] * 25 and sum(len(y) for r in ranks for _, y in r) == 300
    shares = StreamShares(ShuffledStream(num_samples=100), 10, 300, 12, train=False)
    with pytest.raises(ConfigError, match=r"^data: the stream \(ShuffledStream\) ended after 100 samples"):
        list(shares)
    with pytest.raises(ConfigError, match=r"^data\.num_samples=null and ShuffledStream has no len\(\)"):
        StreamDataModule(ShuffledStream())


@pytest.mark.slow
def test_a_stream_stopped_on_ddp_2_and_continued_on_ddp_3_ends_with_one_process_weights(tmp_path):
    common = (
        "data=stream", "+data.stream._target_=users_models.ShuffledStream", "data.num_samples=400",
        "data.batch_size=24", "model=mlp", "model.num_features=4", "model.num_classes=3", "accelerator=cpu",
        "trainer.max_epochs=2",
    )  # fmt: skip
    train(compose_cfg(*common, *QUIET), tmp_path / "one")  # what train.py runs, in this process
    runs = {"one": tmp_path / "one/checkpoints/last.ckpt"}
    for name, more in (
        ("stopped", ("strategy=ddp", "devices=2", "trainer.max_steps=19")),
        ("continued", ("strategy=ddp", "devices=3", f"ckpt_path={tmp_path / 'stopped/checkpoints/last.ckpt'}")),
    ):
        proc = run_train(
            *common, *more, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")}
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert leftover(proc.tag) == []
        runs[name] = tmp_path / name / "checkpoints/last.ckpt"
    assert [torch.load(runs[n], weights_only=True)["global_step"] for n in runs] == [26, 19, 26]  # 320 // 24 a pass
    assert max_diff(weights(runs["continued"]), weights(runs["one"])) <= 1e-5
    one, continued = metrics(tmp_path / "one"), metrics(tmp_path / "continued")
    for key in ("val/loss", "val/acc", "test/loss", "test/acc"):
        assert continued[key] == pytest.approx(one[key], abs=1e-5), key


def test_a_map_style_stream_is_refused_naming_what_to_give():
    with pytest.raises(ConfigError) as err:
        StreamDataModule(torch.utils.data.TensorDataset(torch.zeros(4, 2)))
    assert str(err.value) == "data.stream=TensorDataset: give an IterableDataset, +data.stream._target_=my_pkg.MyStream"

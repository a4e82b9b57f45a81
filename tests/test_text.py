"""Variable-length samples with a collate function (issue 52, case 63) and the built-in text task (``data=tokens``,
``model=transformer``): each rank collates its share of a global batch in one order, the Transformer's output does
not depend on the padding, ddp(2) stopped and continued on ddp(3) ends with one process's weights."""

from __future__ import annotations

import pytest
import torch
from conftest import QUIET, compose_cfg, leftover, max_diff, metrics, run_train, weights

from dpddp.data.global_batch import GlobalBatchDataModule, GlobalBatchSampler
from dpddp.data.tokens import PAD, RandomTokens, TokenDataModule, pad_tokens
from dpddp.errors import ConfigError
from dpddp.models.transformer import TextClassifier
from dpddp.nn import assign_layer_keys, sample_keys
from dpddp.run.build import build
from dpddp.run.config import check_config


def _unpadded(tokens: torch.Tensor) -> list[list[int]]:
    return [[t for t in row.tolist() if t != PAD] for row in tokens]


def test_each_rank_collates_its_share_of_a_global_batch_in_one_order_and_evaluation_counts_each_sample_once():
    data = TokenDataModule(num_samples=203, batch_size=8, seed=1)
    data.setup("fit")
    for split, train in (("train", True), ("val", False)):
        size = len(data.splits[split])
        one = list(GlobalBatchSampler(size, 8, 0, 1, train, seed=1))
        shares = [list(GlobalBatchSampler(size, 8, r, 2, train, seed=1)) for r in range(2)]
        seen = []
        for step, ids in enumerate(one):
            tokens, labels = data.splits[split][ids]
            parts = [data.splits[split][shares[r][step]] for r in range(2)]
            assert _unpadded(tokens) == _unpadded(parts[0][0]) + _unpadded(parts[1][0])  # same samples, same order
            assert torch.equal(labels, torch.cat([parts[0][1], parts[1][1]]))
            assert all(p[0].shape[1] == max(map(len, _unpadded(p[0])), default=0) for p in parts if len(p[1]))
            seen += ids.tolist()
        if not train:
            assert sorted(seen) == list(range(size))  # every validation sample once, the last batch too


def test_the_token_module_builds_its_data_in_setup_not_when_constructed():
    assert TokenDataModule(num_samples=50000).dataset is None  # a process that only builds the module draws nothing
    assert TokenDataModule(vocab_size=64, num_classes=100).dataset is None  # a bad size fails in setup, not here
    data = TokenDataModule(num_samples=60, vocab_size=20, num_classes=3, seed=5)
    data.setup("fit")
    made, drawn = data.make_dataset(), RandomTokens(60, 20, 3, seed=5)
    assert all(torch.equal(made[i][0], drawn[i][0]) and made[i][1] == drawn[i][1] for i in range(60))


def test_the_transformers_output_and_sample_dropout_do_not_depend_on_the_padding():
    torch.manual_seed(0)
    model = TextClassifier(vocab_size=16, num_classes=3, max_len=12, dropout=0.5).train()
    assign_layer_keys(model)
    samples = [(torch.randint(1, 16, (n,)), torch.tensor(0)) for n in (3, 7, 5)]
    tight, _ = pad_tokens(samples)
    wide = torch.cat([tight, torch.full((3, 5), PAD)], dim=1)
    with sample_keys(0, 0, torch.tensor([4, 9, 2])):  # keyed masks: a position's does not depend on the width
        assert (model(tight) - model(wide)).abs().max() <= 1e-6
    assert model(tight[:0]).shape == (0, 3)  # an empty evaluation chunk


def test_samples_that_do_not_stack_streams_and_executions_of_collated_batches_are_one_line():
    with pytest.raises(ConfigError, match=r"^data: two training samples do not collate .* need data\.collate_fn="):
        GlobalBatchDataModule(RandomTokens(num_samples=40))  # case 63: no collate_fn
    GlobalBatchDataModule(RandomTokens(num_samples=40), 8, collate_fn="dpddp.data.tokens.pad_tokens").setup("fit")
    stream = compose_cfg(
        "data=dataset", "+data.dataset._target_=users_models.StreamBlobs", "model.num_features=4", "model.num_classes=3"
    )
    with pytest.raises(ConfigError, match=r"^data\.dataset \(StreamBlobs\) is an IterableDataset"):
        check_config(stream)  # case 62: before anything starts
    collated = compose_cfg("data=tokens", "model=transformer", "steps_per_execution=4")
    with pytest.raises(ConfigError, match=r"^steps_per_execution=4 with data\.collate_fn=dpddp\.data\.tokens"):
        check_config(collated)
    cfg = compose_cfg("data=tokens", "model=transformer")
    check_config(cfg)
    model = build(cfg.model, "model")
    assert isinstance(model, TextClassifier) and model.hparams["vocab_size"] == cfg.data.vocab_size == 64


MICRO = "data.micro_batch_size=5"


@pytest.mark.slow
def test_the_text_example_on_ddp_2_stopped_and_continued_on_ddp_3_ends_with_one_process_weights(tmp_path):
    """Stopped and continued in micro-batches of 5 (each rank's collated share cut along dim 0)."""
    common = (
        "data=tokens", "model=transformer", "data.num_samples=480", "data.batch_size=24", "accelerator=cpu",
        "trainer.max_epochs=2",
    )  # fmt: skip
    from dpddp.run.training import train

    train(compose_cfg(*common, *QUIET), tmp_path / "one")  # what train.py runs, in this process
    runs = {"one": tmp_path / "one/checkpoints/last.ckpt"}
    for name, more in (
        ("stopped", ("strategy=ddp", "devices=2", "trainer.max_steps=7", MICRO)),
        ("continued", ("strategy=ddp", "devices=3", f"ckpt_path={tmp_path / 'stopped/checkpoints/last.ckpt'}", MICRO)),
    ):
        proc = run_train(*common, *more, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert leftover(proc.tag) == []
        runs[name] = tmp_path / name / "checkpoints/last.ckpt"
    assert [torch.load(runs[n], weights_only=True)["global_step"] for n in runs] == [32, 7, 32]
    # Promise 1's tolerance for padded batches: each rank pads its share to its own longest sequence, so its
    # matrix products run over other widths (rounding only: padded positions are masked); measured 2.4e-7.
    assert max_diff(weights(runs["continued"]), weights(runs["one"])) <= 1e-5
    one, continued = metrics(tmp_path / "one"), metrics(tmp_path / "continued")
    for key in ("val/loss", "val/acc", "test/loss", "test/acc"):
        assert continued[key] == pytest.approx(one[key], abs=1e-5), key

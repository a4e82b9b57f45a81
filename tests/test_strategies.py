"""The dp strategy: registration, CPU behaviour, forward replication mechanics, checkpoint portability."""

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, compose_cfg, leftover, max_diff, run_train, weights

from dpddp import DataParallelStrategy
from dpddp.models.linear import LinearClassifier
from dpddp.parallel.dp import replicate_forward, restore_forward
from dpddp.run.training import train

SMALL = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_dp_is_registered_with_lightning():
    trainer = pl.Trainer(strategy="dp", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.world_size == 1 and trainer.strategy.root_device == torch.device("cpu")


def test_dp_over_several_cpu_devices_points_to_ddp():
    with pytest.raises(ValueError, match=r"strategy=dp with devices=2 on cpu: .*use strategy=ddp devices=2"):
        pl.Trainer(strategy="dp", accelerator="cpu", devices=2, logger=False)


def test_replicated_forward_is_the_modules_own_and_leaves_the_state_dict_alone():
    # Without CUDA, nn.DataParallel is a pass-through: this checks the routing, not the scatter.
    model = LinearClassifier(num_features=5, num_classes=3)
    x = torch.randn(7, 5)
    expected = model(x)
    keys = list(model.state_dict())
    replicate_forward(model, [])
    out = model(x)
    assert torch.equal(out, expected)
    assert list(model.state_dict()) == keys  # no "forward.module..." entries, no recursion
    out.sum().backward()
    assert model.linear.weight.grad is not None
    restore_forward(model)
    assert "forward" not in model.__dict__ and torch.equal(model(x), expected)


def test_restoring_the_forward_keeps_a_forward_the_model_set_on_itself():
    """dp on one device replicates nothing; its teardown leaves a model's own instance ``forward`` in place."""
    model = LinearClassifier(num_features=5, num_classes=3)
    model.forward = own = lambda x: x  # type: ignore[method-assign]
    restore_forward(model)
    assert model.__dict__["forward"] is own


def test_dp_checkpoint_holds_plain_weights_and_resumes_under_auto(tmp_path):
    train(compose_cfg(*SMALL, "strategy=dp", "trainer.max_epochs=2"), tmp_path / "dp")
    state = torch.load(tmp_path / "dp/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert {"linear.weight", "linear.bias"} <= state.keys() and not any(k.startswith("module.") for k in state)
    ckpt = tmp_path / "dp/checkpoints/last.ckpt"
    train(compose_cfg(*SMALL, "strategy=auto", "trainer.max_epochs=4", f"ckpt_path={ckpt}"), tmp_path / "auto")
    train(compose_cfg(*SMALL, "strategy=dp", "trainer.max_epochs=4"), tmp_path / "straight")
    last = "checkpoints/last.ckpt"
    assert max_diff(weights(tmp_path / "auto" / last), weights(tmp_path / "straight" / last)) <= 1e-6


@pytest.mark.slow
def test_dp_checkpoint_resumes_under_ddp_and_back(tmp_path):
    args = ["accelerator=cpu", "data.num_samples=1005", "model.optimizer=adam", "model.lr=0.01"]
    train(compose_cfg(*args, *QUIET, "strategy=dp", "trainer.max_epochs=2"), tmp_path / "dp")
    ddp = run_train(
        *args,
        "strategy=ddp",
        "devices=2",
        "trainer.max_epochs=4",
        "ckpt_path=dp/checkpoints/last.ckpt",
        "hydra.run.dir=ddp",
        cwd=tmp_path,
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert leftover(ddp.tag) == []
    ckpt = tmp_path / "ddp/checkpoints/last.ckpt"
    train(compose_cfg(*args, *QUIET, "strategy=dp", "trainer.max_epochs=6", f"ckpt_path={ckpt}"), tmp_path / "back")
    train(compose_cfg(*args, *QUIET, "strategy=auto", "trainer.max_epochs=6"), tmp_path / "straight")
    last = "checkpoints/last.ckpt"
    assert max_diff(weights(tmp_path / "back" / last), weights(tmp_path / "straight" / last)) <= 1e-5


@pytest.mark.gpu
@needs_cuda
def test_dp_on_one_gpu_equals_auto_on_one_gpu(tmp_path):
    gpu = [*QUIET, "accelerator=gpu", "logger=none", "data.num_samples=1005", "trainer.max_epochs=3"]
    auto = train(compose_cfg(*gpu, "strategy=auto"), tmp_path / "auto")
    dp = train(compose_cfg(*gpu, "strategy=dp"), tmp_path / "dp")
    last = "checkpoints/last.ckpt"
    assert max_diff(weights(tmp_path / "auto" / last), weights(tmp_path / "dp" / last)) <= 1e-5
    assert dp["val/acc"] == pytest.approx(auto["val/acc"], abs=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_dp_over_all_gpus_matches_one_gpu(tmp_path):
    n = torch.cuda.device_count()
    gpu = [*QUIET, "accelerator=gpu", "logger=none", "data.num_samples=1005", "trainer.max_epochs=3"]
    one = train(compose_cfg(*gpu, "strategy=auto"), tmp_path / "one")
    dp = train(compose_cfg(*gpu, "strategy=dp", f"devices={n}"), tmp_path / "all")
    assert dp["world_size"] == 1 and dp["val/acc"] >= 0.9
    for key in ("val/loss", "val/acc", "test/loss", "test/acc"):
        assert dp[key] == pytest.approx(one[key], abs=1e-4), key

"""Case 67: a model or data config may leave any key to its class's defaults, as Hydra ``_target_`` configs do;
the checks read the defaults from the class's signature. And a preset without Hydra's package header is told so."""

import pytest
import torch
from conftest import QUIET, compose_cfg
from torch import nn

from dpddp.errors import ConfigError
from dpddp.models.classifier import Classifier
from dpddp.run.config import check_config
from dpddp.run.training import train

TINY = [*QUIET, "accelerator=cpu", "data.num_samples=400", "trainer.max_epochs=1"]


class TwoLayer(Classifier):
    """A network of a user's own in ``Classifier`` (the docs' pattern), every setting with a default."""

    def __init__(
        self,
        num_features: int = 16,
        num_classes: int = 4,
        width: int = 8,
        optimizer: str = "adam",
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(num_classes)
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(num_features, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _hparams(run) -> dict:
    return torch.load(run / "checkpoints/last.ckpt", weights_only=False)["hyper_parameters"]


def test_the_mlp_with_a_partial_config_trains_with_the_class_defaults(tmp_path):
    """The case's ``model/mlp_short.yaml``: only sizes and ``lr`` given; hidden, dropout, optimizer, momentum and
    weight_decay are the class's (adam, [128])."""
    left = ["~model.hidden", "~model.dropout", "~model.optimizer", "~model.momentum", "~model.weight_decay"]
    cfg = compose_cfg(*TINY, "model=mlp", *left, "model.lr=0.05")
    assert sorted(cfg.model) == ["_target_", "lr", "num_classes", "num_features"]
    train(cfg, tmp_path)
    hp = _hparams(tmp_path)
    assert (hp["optimizer"], list(hp["hidden"]), hp["lr"], hp["weight_decay"]) == ("adam", [128], 0.05, 0.0)
    assert sorted(cfg.model) == ["_target_", "lr", "num_classes", "num_features"]  # the run's config is unchanged


def test_a_classifier_subclass_and_the_data_with_partial_configs_train(tmp_path):
    cfg = compose_cfg(
        *TINY, "model=mlp", f"model._target_={__name__}.TwoLayer", "~model.hidden", "~model.dropout",
        "~model.optimizer", "~model.momentum", "~model.weight_decay", "~model.lr", "~data.label_noise", "~data.seed",
    )  # fmt: skip
    train(cfg, tmp_path)
    assert (_hparams(tmp_path)["optimizer"], _hparams(tmp_path)["lr"]) == ("adam", 0.01)
    state = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert state["net.0.weight"].shape == (8, 16)  # width: the class's 8; num_features: the data's 16


def test_a_bad_value_is_still_checked_and_a_bad_default_too():
    with pytest.raises(ConfigError, match="model.lr=-1.0 is out of range|model.lr"):
        check_config(compose_cfg(*TINY, "model=mlp", "~model.optimizer", "model.lr=-1.0"))
    with pytest.raises(ConfigError, match="^model.optimizer='rmsprop' is unknown"):  # the class's own default
        check_config(
            compose_cfg(*TINY, "model=mlp", *MLP_ONLY, "~model.optimizer", f"model._target_={__name__}.RmsNet")
        )


MLP_ONLY = ("~model.hidden", "~model.dropout")


class RmsNet(TwoLayer):
    def __init__(self, optimizer: str = "rmsprop", **kwargs) -> None:
        super().__init__(optimizer=optimizer, **kwargs)


def test_a_preset_without_the_package_header_is_told_so(tmp_path):
    """Case 17's preset without ``# @package _global_``: its keys land under ``experiment.``; the line names the
    header, not the nearest key (was: did you mean checkpoint?)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment/mine.yaml").write_text("seed: 7\ndata:\n  batch_size: 128\n")
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine", "accelerator=cpu"))
    assert str(err.value) == (
        "unknown setting experiment: the experiment= preset's keys are under experiment. because its file lacks "
        "Hydra's package header: make '# @package _global_' its first line"
    )

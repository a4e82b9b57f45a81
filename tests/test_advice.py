"""Each refusal's advice, applied as its line gives it: the advised overrides, in place of the refused one, pass the
check, or at least meet no second refusal of the same setting."""

from __future__ import annotations

import re
import socket

import lightning.pytorch as pl
import pytest
import torch
from conftest import compose_cfg

from dpddp.errors import ConfigError
from dpddp.run.config import check_config


class SmallNet(pl.LightningModule):
    """A user's model given by ``_target_`` alone: it takes none of the packaged model config's sizes."""

    def __init__(self, p: float = 0.25, lr: float = 3e-3) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Dropout(p), torch.nn.LazyLinear(4))


OWN = ["data=dataset", "+data.dataset._target_=users_models.NoisyBlobs", "model._target_=test_advice.SmallNet"]
CPU = ["accelerator=cpu"]

# (overrides refused, the advice as the line prints it, the overrides it replaces)
ADVICE = [
    ([*CPU, "devices=-1"], ["devices=2"], ["devices=-1"]),
    ([*CPU, "devices=2"], ["strategy=ddp"], []),
    ([*CPU, "num_nodes=2"], ["strategy=ddp", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29555"], []),  # node 0, here
    ([*CPU, "strategy=dp", "devices=2"], ["strategy=ddp", "devices=2"], ["strategy=dp"]),
    ([*CPU, "strategy=ddp", "devices=2", "trainer.precision=16-true"], ["trainer.precision=bf16-mixed"], []),
    (
        ["trainer.overfit_batches=2"],
        ["trainer.limit_train_batches=2", "trainer.limit_val_batches=2"],
        ["trainer.overfit_batches=2"],
    ),
    (
        ["trainer.barebones=true"],
        ["trainer.enable_progress_bar=false", "epoch_lines=false", "logger=none"],
        ["trainer.barebones=true"],
    ),
    (
        ["logger=none", "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"],
        ["logger=csv"],
        ["logger=none"],
    ),
    (
        ["steps_per_execution=16", "trainer.accumulate_grad_batches=2"],
        ["steps_per_execution=1"],
        ["steps_per_execution=16"],
    ),
    ([*CPU, "strategy.name=ddp_fork"], ["strategy=ddp", "strategy.launch=fork"], ["strategy.name=ddp_fork"]),
    (["trainer.enable_checkpointing=false"], ["callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null"], []),
    (  # the data set's key is absent from data=dataset's yaml: Hydra adds it with + only
        ["data=dataset", "model.num_features=16", "model.num_classes=4"],
        ["+data.dataset._target_=my_pkg.MyDataset"],
        [],
    ),
    (["data=stream", "model.num_features=16", "model.num_classes=4"], ["+data.stream._target_=my_pkg.MyStream"], []),
    (
        [*OWN, "model.num_features=16", "model.num_classes=4"],
        ["~model.num_features", "~model.num_classes", "~model.optimizer", "~model.momentum", "~model.weight_decay"],
        [],
    ),
]


def _setting(line: str) -> str:
    """The setting a refusal names first: ``unknown setting <key>``, or the ``<key>=`` it starts with."""
    found = re.match(r"unknown setting ([\w.]+)|([\w.]+)=", line)
    assert found, line
    return found.group(1) or found.group(2)


def _refusal(*overrides: str) -> str | None:
    try:
        check_config(compose_cfg(*overrides))
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("given,advice,replaced", ADVICE, ids=[" ".join(a[0])[-60:] for a in ADVICE])
def test_each_refusals_advice_applied_meets_no_second_refusal_of_its_setting(monkeypatch, given, advice, replaced):
    """An advised ``NAME=value`` in capitals is an environment variable the line names (set here as given)."""
    line = _refusal(*given)
    assert line is not None
    env = dict(a.split("=", 1) for a in advice if a.split("=")[0].isupper())
    assert all((a.split("=")[0] if a.split("=")[0] in env else a) in line for a in advice), line  # as printed
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    applied = [o for o in given if o not in replaced] + [a for a in advice if a.split("=")[0] not in env]
    again = _refusal(*applied)
    assert again is None or _setting(again) != _setting(line), f"{line}\nthen: {again}"


def test_a_model_class_that_takes_no_sizes_is_told_what_works_for_it(tmp_path):
    """Case 70: a user's model by ``_target_`` alone, on data without the sizes the packaged model config follows.
    The first line's advice for a class that takes no sizes (a model yaml of its own) runs; the sizes, given to
    it anyway, meet one line naming every packaged key it lacks, whose advice runs too."""
    first = _refusal(*OWN)
    assert first is not None and first.endswith(
        "or, for a class that takes neither, give model a yaml of its own (conf/model/<name>.yaml)"
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "small.yaml").write_text("_target_: test_advice.SmallNet\np: 0.1\n")
    own = [o for o in OWN if not o.startswith("model.")] + [f"hydra.searchpath=[file://{tmp_path}]", "model=small"]
    assert _refusal(*own) is None
    sizes = ["model.num_features=16", "model.num_classes=4"]
    assert _refusal(*OWN, *sizes) == (
        "unknown setting model.num_features: test_advice.SmallNet takes no num_features, num_classes, optimizer, "
        "momentum, weight_decay (of the packaged config): give model a yaml of its own (conf/model/<name>.yaml), or "
        "drop them with ~model.num_features ~model.num_classes ~model.optimizer ~model.momentum ~model.weight_decay"
    )


@pytest.mark.parametrize(
    "given,line",
    [
        (
            ["data=dataset"],
            "data.dataset={} names no class (GlobalBatchDataModule has no data set): give +data.dataset._target_="
            "my_pkg.MyDataset (its arguments as +data.dataset.<arg>=...; dpddp fit: --data.dataset=my_pkg.MyDataset)",
        ),
        (
            ["data=dataset", "+data.dataset._target_=null"],  # the key is there: set without +
            "data.dataset={'_target_': None} names no class (GlobalBatchDataModule has no data set): give "
            "data.dataset._target_=my_pkg.MyDataset (its arguments as +data.dataset.<arg>=...; dpddp fit: "
            "--data.dataset=my_pkg.MyDataset)",
        ),
        (
            ["data=stream"],
            "data.stream={} names no class (StreamDataModule has no data set): give +data.stream._target_="
            "my_pkg.MyStream (its arguments as +data.stream.<arg>=...; dpddp fit: --data.stream=my_pkg.MyStream)",
        ),
    ],
)
def test_the_packaged_data_module_without_a_data_set_is_refused_by_the_check(given, line):
    """Before anything is written (the run's data module said it in ``setup``, after the run directory)."""
    assert _refusal(*given, "model.num_features=16", "model.num_classes=4") == line


def test_a_busy_master_port_names_the_port_and_unsetting_it_binds_a_free_one(monkeypatch):
    from dpddp.parallel.launcher import _bind_store_socket

    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(ConfigError) as err:
            _bind_store_socket("127.0.0.1")
        assert str(err.value) == (
            f"MASTER_PORT={port} on 127.0.0.1 is not free (Address already in use): unset MASTER_PORT to pick a "
            "free port, or choose another"
        )
        monkeypatch.delenv("MASTER_PORT")
        with _bind_store_socket("127.0.0.1") as bound:
            assert bound.getsockname()[1] not in (0, port)

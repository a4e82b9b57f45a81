"""Each reader of another library's error message (``dpddp.messages``) fed the real message, made by that library
here: when a new version words it otherwise, the reader's test fails, not a user's one-line error."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException, MissingConfigException
from hydra.utils import instantiate
from jsonargparse import ActionConfigFile, ArgumentParser

from dpddp._compat import hydra_argument_error
from dpddp.messages import (
    UNUSED_PARAMETERS,
    argparse_choice,
    dataloader_failure,
    defaults_list_parent,
    hydra_override_reason,
    instantiate_key,
    instantiate_target,
    jsonargparse_refusal,
    litlogger_tip,
    locating_failed,
    missing_primary_config,
    mlflow_opt_out,
    named_setting,
    omegaconf_reason,
    unexpected_keyword,
    unrecognized,
    without_torch_prefixes,
)


def test_argparse_choice_reads_hydras_parser_refusing_a_value():
    message = hydra_argument_error(["--cfg", "jobb"])
    assert argparse_choice(message) == ("--cfg", "jobb", ["job", "hydra", "all"])
    assert argparse_choice(hydra_argument_error(["--nope"])) is None


def test_defaults_list_parent_reads_hydras_missing_option(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.yaml").write_text("a: 1\n")
    (tmp_path / "broken.yaml").write_text("defaults:\n  - model: nope\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        with pytest.raises(MissingConfigException) as err:
            compose("broken")
    assert defaults_list_parent(str(err.value).splitlines()[0]) == "broken"
    assert defaults_list_parent("Could not find 'model/nope'") is None
    assert not missing_primary_config(str(err.value).splitlines()[0])
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        with pytest.raises(MissingConfigException) as primary:
            compose("nope")
    assert missing_primary_config(str(primary.value).splitlines()[0])


class Holder:
    def __init__(self, inner: object) -> None:
        self.inner = inner


def test_instantiate_readers_name_the_failed_node_its_target_and_the_refused_argument():
    spec = {"_target_": f"{__name__}.Holder", "inner": {"_target_": "torch.nn.Linear", "in_features": 1, "bad": 2}}
    with pytest.raises(InstantiationException) as err:
        instantiate(spec)
    assert instantiate_key(str(err.value)) == "inner"
    assert instantiate_target(str(err.value)) == "torch.nn.modules.linear.Linear"  # the class found
    assert unexpected_keyword(str(err.value.__cause__)) == "bad"
    with pytest.raises(InstantiationException) as top:
        instantiate({"_target_": "dpddp.nope.Nope"})
    assert instantiate_key(str(top.value)) is None
    assert instantiate_target(str(top.value)) == "dpddp.nope.Nope"
    assert locating_failed(str(top.value)) and not locating_failed(str(err.value))


def test_named_setting_reads_the_argument_a_class_refused():
    from lightning.pytorch.callbacks import ModelCheckpoint

    with pytest.raises(Exception) as err:
        ModelCheckpoint(monitor="val/loss", mode="bad")
    assert named_setting(str(err.value), ["monitor", "mode", "save_top_k"]) == "mode"
    assert named_setting(str(err.value), ["monitor", "save_top_k"]) is None


class OneUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_litlogger_tip_reads_lightnings_advertisement_at_a_trainers_start(caplog, monkeypatch):
    import logging

    import lightning.pytorch as pl

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    monkeypatch.setattr(rank_zero, "filters", [])  # dpddp.run.assembly's filter drops it
    monkeypatch.setattr(rank_zero, "handlers", [caplog.handler])
    monkeypatch.setattr(rank_zero, "level", logging.INFO)
    pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    said = {record.getMessage() for record in caplog.records}
    tips = {message for message in said if litlogger_tip(message)}
    assert len(tips) == 1 and "GPU available: False, used: False" in said - tips, said


def test_unused_parameters_begins_torchs_ddp_error_for_a_parameter_the_loss_did_not_use(tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(OneUsed())
        with pytest.raises(RuntimeError) as err:
            for _ in range(2):
                ddp(torch.ones(1, 2)).sum().backward()
    finally:
        torch.distributed.destroy_process_group()
    assert str(err.value).startswith(UNUSED_PARAMETERS)


class Trainerish:
    def __init__(self, max_epochs: int = 1) -> None:
        self.max_epochs = max_epochs


def _refusal(parser: ArgumentParser, args: list[str]):
    with pytest.raises(Exception) as err:
        parser.parse_args(args)
    return jsonargparse_refusal([line.strip().lstrip("- ") for line in str(err.value).splitlines() if line.strip()])


def test_jsonargparse_refusal_reads_a_wrong_type_a_refused_option_and_a_config_files_unknown_key(tmp_path):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(Trainerish, "trainer")
    parser.add_argument("--model", type=torch.nn.Module)
    typed = _refusal(parser, ["--trainer.max_epochs=abc"])
    assert (typed.key, typed.expected, typed.option, typed.group_key) == ("trainer.max_epochs", ["int"], None, None)
    refused = _refusal(parser, ["--model=torch.nn.Linear", "--model.nope=1"])
    assert (refused.key, refused.class_path, refused.option) == ("model", "torch.nn.Linear", "nope")
    (tmp_path / "bad.yaml").write_text("trainer:\n  nope: 1\n")
    assert _refusal(parser, [f"--config={tmp_path / 'bad.yaml'}"]).group_key == "trainer.nope"
    missing = _refusal(parser, ["--model=pkg.Nope"])
    assert (missing.class_path, missing.detail, missing.cause) == (
        "pkg.Nope",
        "No module named 'pkg'",
        "No module named 'pkg'",
    )
    with pytest.raises(Exception) as err:
        parser.parse_args(["--nope=1"])
    assert unrecognized(str(err.value)) == "--nope=1"
    assert unrecognized('Parser key "trainer.max_epochs":') is None


def test_without_torch_prefixes_reads_a_chained_futures_error():
    head = torch.futures.Future()
    tail = head.then(lambda fut: (_ for _ in ()).throw(ValueError("boom"))).then(lambda fut: fut.wait())
    head.set_result(1)
    with pytest.raises(RuntimeError) as err:
        tail.wait()
    assert str(err.value).splitlines()[0].startswith("Got the following error when running the callback")
    assert without_torch_prefixes(str(err.value).splitlines()[0]) == "boom"
    gloo = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv"
    assert without_torch_prefixes(gloo) == "Timed out waiting 60000ms for recv"


def test_mlflow_opt_out_reads_mlflows_refusal_of_a_file_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow.tracking")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(Exception) as err:
        mlflow.MlflowClient(f"file://{tmp_path / 'mlruns'}")
    assert mlflow_opt_out(str(err.value)) == "MLFLOW_ALLOW_FILE_STORE"
    assert mlflow_opt_out("no such table: experiments") is None


def test_omegaconf_reason_reads_a_failed_interpolation():
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("test_messages.fails"):
        OmegaConf.register_new_resolver("test_messages.fails", lambda: int("x"))
    cfg = OmegaConf.create({"a": "${data.nope}", "b": "${test_messages.fails:}"})
    said = {}
    for key in ("a", "b"):
        with pytest.raises(Exception) as err:
            cfg[key]  # noqa: B018
        said[key] = omegaconf_reason(str(err.value).splitlines()[0])
    assert said == {"a": "Interpolation key 'data.nope' not found", "b": "invalid literal for int() with base 10: 'x'"}


def test_hydra_override_reason_reads_the_grammars_refusal():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with pytest.raises(Exception) as err:
        OverridesParser.create().parse_overrides(["model.lr=["])
    reason = hydra_override_reason(str(err.value))
    assert reason is not None and not reason.startswith(("Error parsing", "See https")) and "[" in str(err.value)


class _Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        import time

        time.sleep(3)
        return i


def test_dataloader_failure_reads_torchs_worker_timeout():
    loader = torch.utils.data.DataLoader(_Slow(), num_workers=1, timeout=0.5)
    with pytest.raises(RuntimeError) as err:
        next(iter(loader))
    assert dataloader_failure(str(err.value).splitlines()[0]) == "a DataLoader worker sent no batch for 0.5 s"
    assert dataloader_failure("CUDA out of memory") is None

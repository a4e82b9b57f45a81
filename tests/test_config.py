import inspect
import re

import lightning.pytorch as pl
import pytest
import torch
import yaml
from conftest import CONF, QUIET, compose_cfg
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict
from torch.utils.data import DataLoader, TensorDataset

from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.errors import ConfigError
from dpddp.models.linear import LinearClassifier
from dpddp.parallel.dp import OneProcessStrategy
from dpddp.run.assembly import build_strategy
from dpddp.run.config import check_config, check_resolvable


def _defaults(cls):
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}


@pytest.mark.parametrize("strategy", ["auto", "dp", "ddp", "ddp_spawn"])
@pytest.mark.parametrize("logger", ["csv", "tensorboard", "none"])
def test_every_option_composes_validates_and_builds(strategy, logger, tmp_path):
    devices = 2 if strategy.startswith("ddp") else 1
    cfg = compose_cfg(f"strategy={strategy}", f"logger={logger}", "accelerator=cpu", f"devices={devices}")
    check_config(cfg)
    built = build_strategy(cfg, None)
    assert isinstance(built, OneProcessStrategy if strategy == "auto" else pl.strategies.Strategy)
    loader = built.process_dataloader(DataLoader(TensorDataset(torch.arange(4.0)), num_workers=1))
    assert loader.multiprocessing_context.get_start_method() == "forkserver", strategy  # every strategy's loaders
    if cfg.logger:
        assert instantiate(cfg.logger, save_dir=str(tmp_path)).save_dir == str(tmp_path)
    for spec in cfg.callbacks.values():
        assert isinstance(instantiate(spec), pl.Callback)


def test_strategy_name_given_by_an_interpolation_builds_that_strategy():
    # check_config and the world read the resolved name (ddp, 2 processes): the built strategy must be ddp's too
    cfg = compose_cfg("strategy=ddp", "accelerator=cpu", "devices=2", "strategy.name=${oc.env:DPDDP_UNSET_NAME,ddp}")
    assert check_config(cfg).world.world_size == 2
    assert type(build_strategy(cfg, None)).__name__ == "DDPStrategy"


def test_strategy_options_given_by_interpolations_reach_the_strategy_resolved(monkeypatch):
    # the checks read resolved values: the strategy must get those, not the ${...} text
    monkeypatch.setenv("DPDDP_LAUNCH", "fork")
    cfg = compose_cfg("strategy=ddp", "accelerator=cpu", "devices=2", "seed=7")
    cfg.strategy.launch, cfg.strategy.timeout_s = "${oc.env:DPDDP_LAUNCH}", "${seed}"
    check_config(cfg)
    built = build_strategy(cfg, None)
    assert (built.launch_mode, built.pg_timeout.total_seconds()) == ("fork", 7.0)


@pytest.mark.parametrize("group,cls", [("data", RandomTensorDataModule), ("model", LinearClassifier)])
def test_config_defaults_match_class_signatures(group, cls):
    """One source of truth: the classes' signatures; the YAML repeats them (and the CLI reads them)."""
    raw = yaml.safe_load((CONF / group / "default.yaml").read_text())
    assert raw.pop("_target_") == f"{cls.__module__}.{cls.__name__}"
    defaults = _defaults(cls)
    assert raw.keys() == defaults.keys()
    for key, value in raw.items():
        if not (isinstance(value, str) and value.startswith("${")):
            assert value == defaults[key], key


def test_trainer_group_holds_only_trainer_flags_at_lightning_defaults():
    raw = yaml.safe_load((CONF / "trainer" / "default.yaml").read_text())
    defaults = _defaults(pl.Trainer)
    own = {"max_epochs": 10, "enable_model_summary": False, "sync_batchnorm": None}  # the project's choices, documented
    for key, value in raw.items():
        assert key in defaults, key
        assert value == own.get(key, defaults[key]), key


def test_defaults_are_valid():
    cfg = compose_cfg()
    check_config(cfg)
    assert OmegaConf.select(cfg, "model.num_features") == cfg.data.num_features


class SizesOnly(torch.nn.Module):
    """A user's model taking the sizes and ``lr`` of ``model/default.yaml``, not its ``optimizer``."""

    def __init__(self, num_features: int = 8, num_classes: int = 3, lr: float = 0.05) -> None:
        super().__init__()


def test_a_target_lacking_a_key_of_the_packaged_config_is_told_the_fix():
    """Found by the fresh-user trial: ``model._target_=X`` on ``model/default.yaml`` named the key, not the fix."""
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg("model._target_=test_config.SizesOnly"))
    assert str(err.value) == (
        "unknown setting model.optimizer: test_config.SizesOnly takes no optimizer, momentum, weight_decay (of the "
        "packaged config): give model a yaml of its own (conf/model/<name>.yaml), or drop them with ~model.optimizer "
        "~model.momentum ~model.weight_decay"
    )
    dropped = ("~model.optimizer", "~model.momentum", "~model.weight_decay")  # the fix, as the line gives it
    check_config(compose_cfg("model._target_=test_config.SizesOnly", *dropped))


BAD = [
    (["+devises=2"], "unknown setting devises: did you mean devices?"),
    (["+data.batchsize=64"], "unknown setting data.batchsize: did you mean data.batch_size?"),
    (["+trainer.max_epoch=3"], "did you mean trainer.max_epochs?"),
    (["+trainer.devices=2"], "trainer.devices is not set in the trainer group: set it at the top level"),
    (["strategy.name=fsdpp"], "strategy='fsdpp' is unknown"),
    (["strategy.name=fsdp"], "strategy=fsdp (FSDPStrategy) is not offered"),
    (["devices=0"], "devices=0 is invalid"),
    (["devices=-2"], "devices=-2 is invalid"),
    (["devices=1.5"], "devices=1.5 is not an integer"),
    (["devices=two"], "devices='two' is not an integer"),
    (["devices=-1", "accelerator=cpu"], "devices=-1 (all GPUs) on CPU"),
    (["num_nodes=0"], "num_nodes=0 is invalid"),
    (
        ["strategy=ddp", "devices=3", "accelerator=cpu"],
        "data.batch_size=64 (global) does not divide by the world size 3",
    ),
    (["strategy=dp", "devices=2", "accelerator=cpu"], "use strategy=ddp devices=2"),
    (["accelerator=gpu"], "CUDA is not available: use accelerator=cpu"),
    (["accelerator=tpu"], "accelerator='tpu' is unknown"),
    (["ckpt_path=/nonexistent/last.ckpt"], "ckpt_path='/nonexistent/last.ckpt' does not exist"),
    (["data.num_samples=0"], "data.num_samples=0 is invalid"),
    (["data.num_features=0"], "data.num_features=0 is invalid"),
    (["data.num_classes=1"], "data.num_classes=1 is invalid"),
    (["data.batch_size=0"], "data.batch_size=0 is invalid"),
    (["data.batch_size=100000"], "larger than the train split"),
    (
        ["data.val_fraction=0.9", "data.test_fraction=0.2"],
        "data.val_fraction=0.9 + data.test_fraction=0.2 leave no training samples",
    ),
    (["data.num_samples=5"], "leaves the val split empty"),
    (["data.label_noise=2"], "data.label_noise=2 is invalid"),
    (["model.lr=-1"], "model.lr=-1 is invalid"),
    (["model.lr=nan"], "model.lr=nan is invalid"),
    (["model.optimizer=rmsprop"], "model.optimizer='rmsprop' is unknown"),
    (["seed=-1"], "seed=-1 is invalid"),
    (["trainer.max_epochs=0"], "trainer.max_epochs=0 is invalid"),
    (["strategy=auto", "devices=2", "accelerator=cpu"], "strategy=auto runs on one device"),
    (["num_nodes=2"], "num_nodes=2 needs one process per device: use strategy=ddp"),
    (["+trainer.val_check_interval=52"], "trainer.val_check_interval=52 is more than the 51 training batches"),
    (
        ["+trainer.val_check_interval=20", "trainer.limit_train_batches=0.25"],
        "trainer.val_check_interval=20 is more than the 12 training batches",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_settings_give_one_line_naming_them(overrides, message):
    if overrides == ["accelerator=gpu"]:
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("CUDA present")
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(*overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_cluster_world_size_mismatch_is_refused(monkeypatch):
    """A cluster task count that disagrees: SLURM started 1 task but devices x num_nodes = 2."""
    env = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_JOB_NAME="train")
    env.update(SLURM_JOB_ID="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"devices=2 x num_nodes=1 = 2 processes, but the cluster started 1"):
        check_config(compose_cfg("strategy=ddp", "devices=2", "accelerator=cpu"))


def test_slurm_launcher_maps_devices_and_num_nodes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", ["hydra/launcher=slurm", "devices=4", "num_nodes=2"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.nodes, launcher.max_num_timeout) == (4, 2, 3)


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", b"PK\x03\x04truncated zip"])
def test_corrupt_checkpoint_is_one_clean_line(tmp_path, content):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(content)
    with pytest.raises(ConfigError, match=r"^ckpt_path=.*last.ckpt. cannot be read as a checkpoint") as err:
        check_config(compose_cfg(f"ckpt_path={bad}"))
    assert "\n" not in str(err.value)


def test_cluster_kubeflow_selects_lightnings_kubeflow_environment(tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments import KubeflowEnvironment

    from dpddp.run.assembly import build_trainer

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", WORLD_SIZE="1", RANK="0").items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg("cluster=kubeflow", "strategy=ddp", "accelerator=cpu", "logger=none")
    trainer = build_trainer(cfg, check_config(cfg).world, tmp_path)
    assert isinstance(trainer.strategy.cluster_environment, KubeflowEnvironment)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"but the cluster started 3 \(WORLD_SIZE=3\)"):
        check_config(cfg)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["strategy=ddp", "strategy.timeout_s=0"], "strategy.timeout_s=0 is invalid"),
        (["strategy=ddp", "strategy.timeout_s=abc"], "strategy.timeout_s='abc' is invalid"),
        (["strategy=ddp", "strategy.process_group_backend=foo"], "strategy.process_group_backend='foo' is unknown"),
        (
            ["strategy=ddp", "+strategy.start_method=spawn"],
            "strategy.start_method='spawn' is not offered: dpddp starts",
        ),
        (["strategy=ddp", "strategy.launch=spawn"], "strategy.launch='spawn' is unknown: use auto, fork (CPU) or exec"),
    ],
)
def test_bad_strategy_options(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(compose_cfg("accelerator=cpu", "devices=2", *overrides))


@pytest.mark.parametrize("backend", ["mpi", "ucc", "nccl"])
def test_a_process_group_backend_this_torch_lacks_is_refused_before_the_ranks_start(backend, monkeypatch):
    """torch would refuse it in every started rank, after the run directory; checked by torch's own
    ``is_<backend>_available``."""
    import torch.distributed as dist

    cfg = compose_cfg("accelerator=cpu", "devices=2", "strategy=ddp", f"strategy.process_group_backend={backend}")
    monkeypatch.setattr(dist, f"is_{backend}_available", lambda: False)
    with pytest.raises(ConfigError, match=rf"^strategy.process_group_backend='{backend}' is not built into this torch"):
        check_config(cfg)
    monkeypatch.setattr(dist, f"is_{backend}_available", lambda: True)
    check_config(cfg)


def test_bad_master_port_in_the_environment(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "abc")
    with pytest.raises(ConfigError, match=r"MASTER_PORT='abc' \(environment\) is not a port"):
        check_config(compose_cfg("strategy=ddp", "accelerator=cpu", "devices=2"))


def test_resume_refusals_name_the_setting_before_anything_starts(tmp_path):
    """A checkpoint with more finished epochs than trainer.max_epochs, and resume=true with other data settings,
    are refused in one line by the check (Lightning refuses the first only inside every started process)."""
    from dpddp.run.training import train

    args = ["accelerator=cpu", "data.num_samples=600", "logger=none", *QUIET]
    train(compose_cfg(*args, "trainer.max_epochs=3"), tmp_path)
    last = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=re.escape("has finished 3 epochs, more than trainer.max_epochs=2")):
        check_config(compose_cfg(*args, "trainer.max_epochs=2", f"ckpt_path={last}"))
    check_config(compose_cfg(*args, "trainer.max_epochs=3", f"ckpt_path={last}", "resume=true"))  # same run: fine
    with pytest.raises(ConfigError, match=re.escape("other data: data.streaming=True (was False)")):
        check_config(
            compose_cfg(*args, "trainer.max_epochs=5", f"ckpt_path={last}", "resume=true", "data.streaming=true")
        )
    check_config(compose_cfg(*args, "trainer.max_epochs=5", f"ckpt_path={last}", "data.num_samples=900"))  # a new run


@pytest.mark.parametrize("key,named", [("dpddp.team", "callbacks.tags.dpddp.team"), (0, "callbacks.tags[0]")])
def test_an_interpolation_under_a_dotted_or_integer_key_that_does_not_resolve_is_refused(key, named):
    """A key with a dot (MLflow's tags are named so) or an integer key is one key, not a dotted path."""
    cfg = compose_cfg("accelerator=cpu")
    with open_dict(cfg):
        cfg.callbacks.tags = OmegaConf.create({key: "${oc.env:DPDDP_NOPE_UNSET}"})
    with pytest.raises(ConfigError) as err:
        check_resolvable(cfg)
    assert str(err.value).startswith(f"{named}='${{oc.env:DPDDP_NOPE_UNSET}}' cannot be resolved ")

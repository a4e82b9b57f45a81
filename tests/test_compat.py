"""Every private Lightning/torch name and behaviour in ``dpddp._compat`` is still there and still does what the
project relies on. An upgrade that moves one fails here, by name, instead of changing behaviour silently."""

from __future__ import annotations

import inspect
import re
import socket
from datetime import timedelta
from importlib.resources import files
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.fabric.utilities import distributed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.model_helpers import is_overridden

from dpddp import DataParallelStrategy, _compat
from dpddp.entry import hydra as hydra_entry
from dpddp.parallel.ddp import DDPStrategy
from dpddp.parallel.launcher import JobLauncher, RankJob
from dpddp.run.training import train_rank


def test_the_launcher_base_is_the_type_lightning_kills_on_ctrl_c():
    assert _compat.SubprocessScriptLauncher is _SubprocessScriptLauncher
    assert "isinstance(launcher, _SubprocessScriptLauncher)" in inspect.getsource(call._call_and_handle_interrupt)


def test_lightning_reads_the_public_launcher_property_at_every_stage():
    """DDPStrategy swaps in its JobLauncher through ``Strategy.launcher``; Lightning must read it there."""
    assert "trainer.strategy.launcher" in inspect.getsource(call._call_and_handle_interrupt)
    assert isinstance(inspect.getattr_static(pl.strategies.Strategy, "launcher"), property)


def test_a_ddp_trainer_with_a_job_gets_the_projects_launcher_not_lightnings():
    """The bug the project exists to fix: Lightning's launcher replays sys.argv (and Hydra sweeps) in every rank."""
    job = RankJob(entry=f"{train_rank.__module__}:train_rank", config={"devices": 2}, output_dir=".")
    trainer = pl.Trainer(
        strategy=DDPStrategy(job=job), accelerator="cpu", devices=2, logger=False, enable_checkpointing=False
    )
    assert isinstance(trainer.strategy.launcher, JobLauncher)
    assert trainer.strategy.launcher.fork  # CPU without CUDA initialised: forked ranks
    plain = pl.Trainer(strategy=DDPStrategy(), accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    assert type(plain.strategy.launcher) is _SubprocessScriptLauncher


def test_dist_connection_helpers_keep_their_signatures():
    params = inspect.signature(distributed._init_dist_connection).parameters
    assert list(params)[:2] == ["cluster_environment", "torch_distributed_backend"] and "kwargs" in params
    assert "num_processes" in inspect.signature(distributed._set_num_threads_if_needed).parameters
    assert isinstance(_compat._TORCH_GREATER_EQUAL_2_3, bool)
    source = inspect.getsource(LightningDDPStrategy.setup_distributed)
    assert "_TORCH_GREATER_EQUAL_2_3" in source and "device_id" in source  # the guard the copy keeps
    assert callable(LightningDDPStrategy._get_process_group_backend)


def test_resolve_process_group_backend_sets_what_the_public_property_reads():
    strategy = LightningDDPStrategy(accelerator="cpu", parallel_devices=[torch.device("cpu")])
    assert _compat.resolve_process_group_backend(strategy) == "gloo"
    assert strategy.process_group_backend == "gloo"


def test_rank0_store_takes_a_bound_socket_and_meets_env_rendezvous_keys():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    store = _compat.rank0_store(sock, world_size=1, timeout=timedelta(seconds=10))
    store.set("k", "v")
    client = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("default_pg/k") == b"v"  # what an env:// rank's PrefixStore("default_pg") reads


def test_sigterm_broadcast_is_a_method_of_the_epoch_loop_called_before_each_step():
    assert callable(_TrainingEpochLoop._broadcast_sigterm_tensor)
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    _compat.disable_sigterm_broadcast(trainer)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
    _compat.restore_sigterm_broadcast(trainer)
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)


def test_the_data_position_comes_from_the_batches_completed_in_all():
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    assert _compat.data_position(trainer) == (0, 0)  # before a fit: no batches per epoch yet
    trainer.fit_loop.max_batches = 12  # what num_training_batches reads
    trainer.fit_loop.epoch_loop.batch_progress.total.completed = 31  # restored from a checkpoint
    assert trainer.num_training_batches == 12 and _compat.data_position(trainer) == (2, 7)


def test_an_unfinished_epoch_is_recorded_as_such():
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    trainer.fit_loop.max_batches = 12
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 5
    counters = {"ready": 2, "started": 2, "processed": 2, "completed": 2}  # what a fit that ended leaves
    checkpoint = {"loops": {"fit_loop": {"epoch_progress": {"total": dict(counters), "current": dict(counters)}}}}
    _compat.keep_unfinished_epoch(trainer, checkpoint)
    assert checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"] == {
        "ready": 2, "started": 2, "processed": 1, "completed": 1
    }  # fmt: skip
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 12  # the epoch ran to its end: unchanged
    checkpoint = {"loops": {"fit_loop": {"epoch_progress": {"total": dict(counters), "current": dict(counters)}}}}
    _compat.keep_unfinished_epoch(trainer, checkpoint)
    assert checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"] == counters


def test_lightning_sets_the_hook_name_attribute_on_the_module():
    module = pl.LightningModule()
    assert _compat.HOOK_NAME_ATTRIBUTE in vars(module)
    assert f"self.{_compat.HOOK_NAME_ATTRIBUTE}" in inspect.getsource(pl.LightningModule.log)


def test_lightning_calls_batch_hooks_only_through_the_loop_that_skips_what_is_not_callable():
    """``skip_empty_batch_hooks``: Lightning's hook loop skips a hook that is not callable and is the only caller of
    the per-batch hooks; a callback with its empty hooks set to ``None`` trains as before, its own hook still
    called, and reads as not overriding them."""
    assert "if callable(fn):" in inspect.getsource(call._call_callback_hooks)
    package = Path(pl.__file__).parent
    direct = re.compile(rf"\b(self|callback|cb)\.({'|'.join(_compat.PER_BATCH_HOOKS)})\(")  # not through the loop
    assert [str(path.relative_to(package)) for path in package.rglob("*.py") if direct.search(path.read_text())] == []
    ends = []

    class Counting(pl.Callback):
        def on_train_batch_end(self, *args: object) -> None:
            ends.append(args[-1])

    counting = Counting()
    trainer = pl.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[counting])  # fmt: skip
    _compat.skip_empty_batch_hooks(trainer.callbacks)
    assert vars(counting)["on_before_backward"] is None and "on_train_batch_end" not in vars(counting)
    assert not is_overridden("on_before_backward", counting, pl.Callback)
    trainer.fit(BoringModel())
    assert ends == [0, 1, 2]


def test_dp_gets_its_devices_through_parallel_devices():
    """Lightning's connector fills ``parallel_devices`` of a strategy that has the attribute (hasattr)."""
    trainer = pl.Trainer(strategy=DataParallelStrategy(), accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.parallel_devices == [torch.device("cpu")]
    with pytest.raises(ValueError, match="strategy=dp with devices=2 on cpu"):
        pl.Trainer(strategy=DataParallelStrategy(), accelerator="cpu", devices=2, logger=False)


def test_checked_versions_are_recorded():
    assert set(_compat.CHECKED) == {"lightning", "torch", "hydra-core"}


def test_hydra_main_composes_a_first_time_only_to_read_the_mode_and_reads_none_when_none_is_set():
    """``hydra_mode_unset``: ``hydra.main`` asks ``Hydra.get_mode`` before composing to run, and ``get_mode`` is the
    ``hydra.mode`` of a composition, ``None`` when it fails; inside the block it is ``None`` without composing."""
    from hydra._internal import utils as hydra_utils
    from hydra._internal.hydra import Hydra

    assert "run_mode = hydra.get_mode(config_name=config_name, overrides=overrides)" in inspect.getsource(
        hydra_utils._run_hydra
    )
    source = inspect.getsource(Hydra.get_mode)
    assert "return cfg.hydra.mode" in source and "except Exception:\n            return None" in source
    get_mode = Hydra.get_mode
    with _compat.hydra_mode_unset():
        assert Hydra.get_mode(None, "config", []) is None  # type: ignore[arg-type]
    assert Hydra.get_mode is get_mode


def test_only_the_mode_groups_set_the_hydra_mode_and_the_command_lines_that_may_are_known():
    """The premise of skipping Hydra's first composition (``dpddp.entry.hydra.sets_no_mode``): composed alone,
    every packaged option leaves ``hydra.mode`` unset except those of ``MODE_GROUPS``."""
    conf = Path(str(files("dpddp.conf")))
    options = sorted(p.relative_to(conf).with_suffix("") for p in conf.rglob("*.yaml") if p.parent != conf)
    assert len(options) > 20
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for option in options:
            group, name = str(option.parent), option.name
            cfg = compose(config_name="config", overrides=[f"{group}={name}"], return_hydra_config=True)
            assert (cfg.hydra.mode is not None) == (group in hydra_entry.MODE_GROUPS), option
    assert hydra_entry.sets_no_mode([]) and hydra_entry.sets_no_mode(["-m", "strategy=ddp", "devices=1,2", "seed=0"])
    for argv in (["hparams_search=optuna"], ["+hydra.mode=MULTIRUN"], ["--config-dir", "conf"], ["-cn", "other"],
                 ["--config-path=x"], ["hydra.searchpath=[file://conf]"]):  # fmt: skip
        assert not hydra_entry.sets_no_mode(argv), argv


def test_logged_metric_kinds_reads_lightnings_result_collection():
    """``logged_metric_kinds`` (the metric-contract warning) reads ``Trainer._results``: ``_ResultMetric`` with
    ``is_tensor`` and ``meta.name``, ``meta.sync.should``."""
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    from dpddp._compat import logged_metric_kinds

    assert isinstance(pl.Trainer.__dict__["_results"], property)
    meta = _Metadata("validation_step", "val/acc")
    meta.sync = _Sync(_should=True)
    fake = type("FakeTrainer", (), {"_results": {"validation_step.val/acc": _ResultMetric(meta, is_tensor=True)}})()
    assert logged_metric_kinds(fake) == {"val/acc": (False, True)}  # type: ignore[arg-type]


def test_the_optuna_plugin_launches_through_the_launcher_attribute_the_recording_sweeper_wraps():
    """``RecordingOptunaSweeper`` replaces ``OptunaSweeper.sweeper.launcher`` (hydra-optuna-sweeper 1.3.0)."""
    impl = pytest.importorskip("hydra_plugins.hydra_optuna_sweeper._impl")
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

    assert "self.sweeper = OptunaSweeperImpl(" in inspect.getsource(OptunaSweeper.__init__)
    assert "self.launcher.launch(" in inspect.getsource(impl.OptunaSweeperImpl.sweep)
    assert "max_failure_rate" in inspect.getsource(impl.OptunaSweeperImpl.sweep)


def test_a_cut_execution_is_uncounted_in_a_real_checkpoints_loop_layout(tmp_path):
    """``uncount_last_batch`` and ``epoch_finished_in`` on the checkpoint Lightning itself writes."""
    trainer = pl.Trainer(max_steps=3, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    checkpoint = torch.load(tmp_path / "c.ckpt", weights_only=True)
    loops = checkpoint["loops"]["fit_loop"]
    assert loops["epoch_loop.batch_progress"]["current"]["processed"] == 3
    assert not _compat.epoch_finished_in(trainer, checkpoint)  # 3 of 64 batches
    _compat.uncount_last_batch(checkpoint)
    assert loops["epoch_loop.batch_progress"]["total"] == {"ready": 2, "started": 2, "processed": 2, "completed": 2}
    progress = loops["epoch_progress"]["current"]
    assert progress["processed"] == progress["completed"] == progress["started"] - 1
    loops["epoch_loop.batch_progress"]["current"]["processed"] = trainer.num_training_batches
    assert _compat.epoch_finished_in(trainer, checkpoint)


def test_a_lightning_optimizer_has_the_step_counting_hooks_counted_step_calls():
    raw = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    optimizer, seen = LightningOptimizer(raw), []
    optimizer._on_before_step = lambda: seen.append("before")
    optimizer._on_after_step = lambda: seen.append("after")
    raw.param_groups[0]["params"][0].grad = torch.ones(1)
    _compat.counted_step(optimizer)
    assert seen == ["before", "after"] and optimizer.optimizer is raw
    assert raw.param_groups[0]["params"][0].item() == 0.0  # the raw step ran


def test_torchrun_tells_its_workers_when_they_get_the_agent_store(monkeypatch):
    """``agent_store`` keys on the variable the agent sets for its workers; the store it hands them is the one
    every restart reuses (static rendezvous: created once; c10d: the cached shared server)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, static_tcp_rendezvous

    assert f'"{_compat.AGENT_STORE_ENV}": str(use_agent_store)' in inspect.getsource(LocalElasticAgent._start_workers)
    assert "if not self._store:" in inspect.getsource(static_tcp_rendezvous.StaticTCPRendezvous.next_rendezvous)
    assert "_shared_tcp_store_server is None" in inspect.getsource(
        dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous
    )
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.delenv(_compat.AGENT_STORE_ENV, raising=False)
    assert _compat.agent_store("127.0.0.1", server.port, timedelta(seconds=5)) is None
    monkeypatch.setenv(_compat.AGENT_STORE_ENV, "True")
    client = _compat.agent_store("127.0.0.1", server.port, timedelta(seconds=5))
    client.set("k", "v")
    assert server.get("k") == b"v"


def test_hydras_basic_launcher_is_the_target_the_sweep_summary_names():
    """``HYDRA_BASIC_LAUNCHER`` is the ``_target_`` the packaged config composes for ``hydra/launcher=basic`` (the
    default), and it names Hydra's launcher class."""
    from hydra.plugins.launcher import Launcher
    from hydra.utils import get_class

    with initialize_config_dir(config_dir=str(files("dpddp.conf")), version_base="1.3"):
        for overrides in ([], ["hydra/launcher=basic"]):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            assert cfg.hydra.launcher._target_ == _compat.HYDRA_BASIC_LAUNCHER, overrides
    assert issubclass(get_class(_compat.HYDRA_BASIC_LAUNCHER), Launcher)

"""The surface: every setting a user can reach, and whether the five promises hold on it or it is refused.

Test metadata, not part of the package: one table (``SURFACE``); the README's "The promises, and what is
supported" table is generated from it (``python tests/surface.py`` prints it) and ``tests/test_surface.py`` walks
it: each supported Trainer flag is stopped at a seeded random step and continued, and must end with a straight
run's weights, and run on 2 ddp processes, it must end with one process's step, weights and metrics (unless a
refused row says it is one process only); each refused setting must give its one line; every other row names the
tests that check its promises, and each of them must be a test pytest collects, not skipped on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SURFACE", "Setting", "markdown"]


@dataclass(frozen=True)
class Setting:
    """One row of the surface.

    Attributes:
        kind: ``"trainer flag"``, ``"run setting"``, ``"strategy"``, ``"entry point"``, ``"sweeper/launcher"``
            or ``"model"`` (a kind of layer a user's model has; walked like a flag, and on 2 and 3 processes).
        name: what the user writes, e.g. ``trainer.accumulate_grad_batches=3``.
        overrides: ``train.py`` overrides that reach it (trainer flags: what the contract test runs).
        refused: the start of the one ``error:`` line for a refused setting; empty for a supported one.
        tested_by: ``file::test`` names of the tests that check the promises on it (a Trainer flag with
            tests of its own is not walked by the stop-and-continue contract test).
        note: what to know (one line).
    """

    kind: str
    name: str
    overrides: tuple[str, ...] = ()
    refused: str = ""
    tested_by: tuple[str, ...] = ()
    note: str = ""


def _flag(name: str, *overrides: str, note: str = "", refused: str = "") -> Setting:
    return Setting("trainer flag", name, overrides or (name,), refused, note=note)


SWEEP_SIGTERM = (
    "a SIGTERM to the sweep or to any of its processes: the running jobs stop at a step end with their checkpoint, "
    "the summary is written, one line resumes the sweep, exit 143"
)
"""The note of each local launcher's row (``dpddp.continuity.stop``)."""

SURFACE: tuple[Setting, ...] = (
    _flag("trainer.max_epochs=N", "trainer.max_epochs=3"),
    _flag("trainer.max_steps=N", "trainer.max_steps=30", note="a stop mid-epoch continues inside the epoch"),
    _flag("trainer.accumulate_grad_batches=K", "trainer.accumulate_grad_batches=3"),
    _flag("trainer.gradient_clip_val=V", "trainer.gradient_clip_val=0.5"),
    _flag("trainer.limit_train_batches=N", "trainer.limit_train_batches=5"),
    _flag("trainer.limit_val_batches=N", "trainer.limit_val_batches=2"),
    _flag("+trainer.val_check_interval=N", "+trainer.val_check_interval=4"),
    _flag("trainer.check_val_every_n_epoch=N", "trainer.check_val_every_n_epoch=2"),
    _flag("trainer.reload_dataloaders_every_n_epochs=N", "trainer.reload_dataloaders_every_n_epochs=1"),
    Setting(
        "trainer flag",
        "trainer.precision=bf16-mixed or 16-mixed (any number of processes or dp replicas)",
        tested_by=(
            "test_precision.py::test_16_bits_over_2_and_3_processes_add_at_most_three_times_what_16_bits_cost_one_process",
            "test_precision.py::test_a_sigterm_in_bf16_then_continued_equals_the_straight_bf16_run",
            "test_precision.py::test_the_gradient_scalers_state_travels_in_the_checkpoint_and_a_stop_continues_exactly",
        ),
        note="weights and the gradient all-reduce stay 32-bit; promise 1 in 16 bits: ddp's distance to one "
        "process is at most 3 x max(1e-5, what 16 bits cost one process), measured 0.46-2.49 x on CPU bf16 (48 runs: "
        "ddp 2 and 3, 8 seeds, 48 and 680 steps, with and without accumulation); a stop continues exactly (1e-6), "
        "the scaler's state in the checkpoint; 16-mixed is bf16 on CPU",
    ),
    Setting(
        "trainer flag",
        "trainer.precision=bf16-true or 16-true (16-bit weights) with more than one process",
        ("strategy=ddp", "devices=2", "accelerator=cpu", "trainer.precision=bf16-true"),
        refused="trainer.precision=bf16-true with 2 processes: the weights and the gradient all-reduce would be 16-bit",
        note="one process keeps it",
    ),
    _flag(
        "callbacks=early_stopping",
        "callbacks=early_stopping",
        "callbacks.early_stopping.patience=0",
        "callbacks.early_stopping.min_delta=0.25",  # the contract test's run: it ends the run after epoch 2 of 3
        note="a run it ended stays ended",
    ),
    Setting(
        "trainer flag",
        "EarlyStopping with trainer.min_epochs (tripped before min_epochs)",
        tested_by=("test_stop_kinds.py::test_loop_flags_latched_by_a_callback_travel_in_the_checkpoint",),
        note="the should_stop it latched travels in the checkpoint: a continued run stops at min_epochs, as the "
        "straight run does",
    ),
    _flag(
        "callbacks=swa (SWA)",  # the name seeds the contract test's stop: step 21, in the window
        "callbacks=swa",
        "callbacks.swa.swa_epoch_start=1",
        note="last.ckpt and val/* are the average's",
    ),
    _flag(
        "callbacks=ema",
        "callbacks=ema",
        "callbacks.ema.decay=0.9",
        note="last.ckpt, val/*, test/*: the average's",
    ),
    _flag("callbacks=model_checkpoint", "callbacks=model_checkpoint"),
    _flag(
        "callbacks=[early_stopping,lr_monitor] logger=csv",
        "logger=csv",
        "callbacks=[early_stopping,lr_monitor]",
        "callbacks.early_stopping.patience=0",
        "callbacks.early_stopping.min_delta=0.25",
    ),
    _flag(
        "ModelCheckpoint with every_n_train_steps (+callbacks.every_steps)",
        "+callbacks.every_steps._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        "+callbacks.every_steps.every_n_train_steps=5",
        note="its checkpoints go to <run dir>/checkpoints; one written inside an epoch continues like a SIGTERM's",
    ),
    _flag(
        "ModelCheckpoint with train_time_interval (+callbacks.every_time)",
        "+callbacks.every_time._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        "+callbacks.every_time.train_time_interval._target_=datetime.timedelta",
        "+callbacks.every_time.train_time_interval.seconds=1",
        note="a timedelta, given as its _target_ and fields",
    ),
    _flag("callbacks=lr_monitor logger=csv", "logger=csv", "callbacks=lr_monitor"),
    Setting(
        "trainer flag",
        "callbacks=none",
        tested_by=(
            "test_presets.py::test_callbacks_none_trains_without_configured_callbacks",
            "test_presets.py::test_trainer_ddp_equals_strategy_ddp",
        ),
    ),
    _flag(
        "BackboneFinetuning (+callbacks.finetune, a model with a backbone)",
        "model=mlp",
        "model._target_=users_models.BackboneMLP",
        "+callbacks.finetune._target_=lightning.pytorch.callbacks.BackboneFinetuning",
        "+callbacks.finetune.unfreeze_backbone_at_epoch=1",
        note="a continued run trains the unfrozen backbone (Lightning's restart refreezes it); under ddp its "
        "gradients are all-reduced once unfrozen: dpddp.parallel.ddp",
    ),
    _flag(
        "a callback of your own with its state in state_dict (+callbacks.counter)",
        "+callbacks.counter._target_=users_models.KeptBatchCounter",
        note="what it does not put in its state_dict a continued run loses: python -m dpddp.check --stops names it",
    ),
    _flag(
        "trainer.barebones=true",
        refused="trainer.barebones=True is not offered: Lightning switches off self.log() and checkpointing in it",
        note="for speed: trainer.enable_progress_bar=false epoch_lines=false logger=none",
    ),
    _flag(
        "a callback that needs a logger (LearningRateMonitor, DeviceStatsMonitor) with logger=none",
        "callbacks=lr_monitor",
        refused="callbacks.lr_monitor (LearningRateMonitor) needs a logger, and logger=none: use logger=csv",
        note="with a logger (logger=csv, ...) it works",
    ),
    _flag(
        "trainer.overfit_batches=N",
        "trainer.overfit_batches=2",
        refused="trainer.overfit_batches=2 is not offered: Lightning replaces the training sampler for it",
    ),
    Setting(
        "trainer flag",
        "trainer.fast_dev_run=true",
        tested_by=(
            "test_limits.py::test_fast_dev_run_writes_no_checkpoint",
            "test_presets.py::test_print_config_logs_the_resolved_tree_once",
        ),
        note="one batch of each stage, no checkpoint or logger files (Lightning's meaning): nothing to resume",
    ),
    Setting(
        "run setting",
        "steps_per_execution=K",
        tested_by=(
            "test_executions.py::test_k_steps_per_execution_equal_one",
            "test_executions.py::test_a_stop_at_a_random_step_then_continued_twice_equals_a_straight_run",
            "test_executions.py::test_sigterm_stops_on_a_step_boundary_and_resumes_exactly",
            "test_executions.py::test_ddp_two_processes_with_k_equal_one_process",
            "test_executions.py::test_what_cannot_keep_the_promises_is_one_line",
            "test_auto_executions.py::test_auto_equals_one_bit_for_bit_and_its_k_is_in_metrics",
            "test_auto_executions.py::test_what_refuses_k_above_one_falls_back_to_one_in_one_line",
        ),
        note="K optimizer steps per loop iteration (default `auto`: timed; 1 unless all run objects are dpddp's or "
        "known by exact type); K > 1 refuses accumulate_grad_batches, val_check_interval, limit_train_batches, "
        "fast_dev_run, profilers, LR schedulers, SWA, dp, your batch/step hooks",
    ),
    Setting(
        "run setting",
        "data.micro_batch_size=N|auto",
        tested_by=(
            "test_micro_batches.py::test_micro_batches_of_n_equal_the_unsplit_run",
            "test_micro_batches.py::test_auto_splits_when_out_of_memory_keeps_the_split_and_equals_the_unsplit_run",
            "test_micro_batches.py::test_a_stop_inside_a_split_step_continues_exactly",
            "test_micro_batches.py::test_ddp_two_processes_split_equal_one_unsplit_process",
            "test_micro_batches.py::test_what_cannot_keep_the_promises_is_one_line",
            "test_micro_batches.py::test_the_transformer_recipe_in_micro_batches_equals_the_unsplit_run_in_64_bits",
        ),
        note="each rank's share in micro-batches, one optimizer step (clipped, schedulers stepped); auto halves the "
        "split when any rank runs out of memory (one all-reduce of the flag a step); BatchNorm, "
        "accumulate_grad_batches and strategy=dp are refused",
    ),
    Setting(
        "run setting",
        "compile=true",
        tested_by=(
            "test_compile.py::test_one_compiled_process_is_within_the_bound_of_eager_and_loads_in_eager",
            "test_compile.py::test_two_compiled_ddp_processes_with_batchnorm_are_within_the_bound_of_one_eager_process",
            "test_compile.py::test_a_compiled_run_stopped_then_continued_equals_the_straight_compiled_run",
            "test_compile.py::test_what_compile_cannot_keep_is_one_line",
            "test_compile.py::test_each_job_of_a_sweep_compiles_afresh",
        ),
        # no note: the README's 25 KiB leave room for the row alone; docs/performance.md has the bounds, dp refused
    ),
    Setting(
        "strategy",
        "strategy=auto",
        tested_by=("test_train.py::test_defaults_learn_and_write_metrics",),
    ),
    Setting(
        "strategy",
        "strategy=dp (one CPU; GPUs)",
        tested_by=("test_train.py::test_dp_on_one_cpu_equals_auto_exactly",),
        note="more than one CPU device is refused: DataParallel replicates over GPUs",
    ),
    Setting(
        "strategy",
        "strategy=ddp",
        tested_by=(
            "test_runs.py::test_ddp_two_processes_equal_one_process",
            "test_faults.py::test_sigterm_stops_with_a_checkpoint_and_resume_equals_uninterrupted",
        ),
    ),
    Setting(
        "strategy",
        "strategy=ddp_spawn",
        tested_by=("test_faults.py::test_sigterm_stops_with_a_checkpoint_and_resume_equals_uninterrupted",),
        note="dpddp's launcher, every rank in a fresh interpreter (not torch.multiprocessing)",
    ),
    Setting(
        "strategy",
        "strategy.start_method=spawn|fork|forkserver",
        ("strategy=ddp", "+strategy.start_method=spawn"),
        refused="strategy.start_method='spawn' is not offered: dpddp starts the ranks itself",
    ),
    Setting(
        "strategy",
        "Lightning's strategy names (ddp_find_unused_parameters_true, ddp_fork, single_device, fsdp, deepspeed, ...)",
        ("strategy.name=ddp_find_unused_parameters_true",),
        refused="strategy=ddp_find_unused_parameters_true is Lightning's name for DDPStrategy(",
        note="each line names dpddp's settings for the name (strategy=ddp strategy.find_unused_parameters=true), or "
        "the strategy to use; the CLI takes the mapped names (--trainer.strategy=ddp_fork)",
    ),
    Setting(
        "strategy",
        "trainer=ddp or ddp_sim",
        tested_by=(
            "test_presets.py::test_trainer_ddp_equals_strategy_ddp",
            "test_presets.py::test_trainer_presets_set_the_top_level_knobs",
        ),
        note="strategy=ddp devices=2",
    ),
    Setting(
        "run setting",
        "trainer=cpu or gpu",
        tested_by=(
            "test_presets.py::test_trainer_presets_set_the_top_level_knobs",
            "test_presets.py::test_each_preset_trains_on_one_process",
        ),
    ),
    Setting(
        "entry point",
        "python train.py",
        tested_by=("test_faults.py::test_killing_rank_1_ends_the_run",),
    ),
    Setting(
        "entry point",
        "python train.py -m (sweeps)",
        tested_by=("test_sweeps.py::test_mixed_strategies_with_a_failing_job_then_resume",),
    ),
    Setting(
        "entry point",
        "dpddp fit ... (Lightning CLI)",
        tested_by=(
            "test_faults.py::test_killing_rank_1_ends_the_run",
            "test_cli.py::test_the_cli_applies_the_checks_of_train_py",
            "test_bring_your_own.py::test_the_lightning_cli_takes_a_users_model_and_data_module_and_equals_the_hydra_entry",
        ),
        note="any LightningModule and LightningDataModule: --model=pkg.Class --data=pkg.Class",
    ),
    Setting(
        "entry point",
        "torchrun / SLURM / a PyTorchJob",
        tested_by=(
            "test_multinode.py::test_two_nodes_on_separate_interfaces_train_one_model",
            "test_cluster.py::test_standalone_torchrun_two_processes",
            "test_cluster.py::test_simulated_slurm_job_with_two_tasks",
            "test_config.py::test_cluster_kubeflow_selects_lightnings_kubeflow_environment",
            "test_multinode.py::test_torchrun_restart_resumes_from_last_ckpt",
        ),
    ),
    Setting(
        "entry point",
        "num_nodes=auto (torchrun --nnodes=MIN:MAX, SLURM, a PyTorchJob)",
        tested_by=(
            "test_elastic.py::test_node_leaving_gracefully_stops_every_rank_at_one_step_and_the_other_continues",
            "test_elastic.py::test_node_killed_the_other_continues_from_last_ckpt",
            "test_elastic.py::test_node_joining_continues_on_the_larger_world_size",
            "test_elastic_rules.py::test_auto_takes_the_slurm_task_count",
        ),
        note="the launcher's world size; every (re)start of the job continues from its last.ckpt (written every 600 "
        "s inside epochs too: checkpoint.every_seconds=auto), on any number of nodes (torchrun: --rdzv-id, and "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for a node that joins)",
    ),
    Setting(
        "sweeper/launcher",
        "basic",
        tested_by=(
            "test_sweeps.py::test_mixed_strategies_with_a_failing_job_then_resume",
            "test_sweeps.py::test_sigterm_to_a_sweep_stops_its_jobs_with_a_checkpoint_and_the_sweep_resumes_exactly",
        ),
        note=SWEEP_SIGTERM,
    ),
    Setting(
        "sweeper/launcher",
        "hydra/launcher=joblib",
        tested_by=(
            "test_sweeps.py::test_sigterm_to_a_sweep_stops_its_jobs_with_a_checkpoint_and_the_sweep_resumes_exactly",
        ),
        note=SWEEP_SIGTERM,
    ),
    Setting(
        "sweeper/launcher",
        "hparams_search=optuna",
        tested_by=(
            "test_sweeps.py::test_optuna_search_records_a_failed_trial_and_goes_on",
            "test_sweeps.py::test_optuna_search_records_a_failed_trial_and_goes_on",
            "test_optuna.py::test_a_stopped_search_continues_with_its_printed_command_to_n_trials_with_nan_trials_failed",
        ),
        note="a failed or NaN trial is FAIL, the search goes on; a SIGTERM's line continues it, no trial run twice",
    ),
    Setting(
        "sweeper/launcher",
        "hydra/launcher=submitit_local",
        tested_by=(
            "test_sweeps.py::test_sigterm_to_a_sweep_stops_its_jobs_with_a_checkpoint_and_the_sweep_resumes_exactly",
        ),
        note=SWEEP_SIGTERM,
    ),
    Setting(
        "model",
        "dropout: model=mlp model.dropout=0.5, or dpddp.nn.SampleDropout in a user's model",
        ("model=mlp", "model.dropout=0.5"),
        note="each sample's mask is a function of (seed, epoch, sample, layer): the same masks on any world size",
    ),
    Setting(
        "model",
        "BatchNorm (nn.BatchNorm1d/2d/3d) in a user's model",
        ("model=mlp", "model._target_=users_models.BatchNormMLP", "model.optimizer=sgd", "model.lr=0.05"),
        note="statistics over the global batch under ddp (trainer.sync_batchnorm=null: on; false: warned, not kept)",
    ),
    Setting(
        "model",
        "randomness from the global stream (nn.Dropout, torch.rand in a step)",
        tested_by=(
            "test_randomness.py::test_a_users_global_rng_model_stopped_mid_epoch_and_continued_equals_the_straight_run",
            "test_randomness.py::test_under_ddp_a_global_rng_layer_is_named_in_one_line_at_start",
            "test_stop_kinds.py::test_random_state_saved_at_one_kind_of_stop_is_restored_at_every_kind",
        ),
        note="each rank's random state travels in the checkpoint: promise 3 on the same world size; under more "
        "than one replica promise 1 does not hold, and one line at start names the layers",
    ),
    Setting(
        "data",
        "random augmentation in a data set's __getitem__ from the global stream (torchvision's transforms)",
        tested_by=(
            "test_randomness.py::test_random_augmentation_in_a_data_set_continues_exactly",
            "test_randomness.py::test_random_augmentation_in_a_users_own_loaders_continues_exactly",
            "test_randomness.py::test_random_augmentation_no_keyed_fetch_serves_is_named_in_one_line",
        ),
        note="torch's, numpy's and Python's streams are keyed by (seed, epoch, sample) for each sample under "
        "data=dataset and data=sharded: exact with or without loader workers; a data module's own loaders used "
        "as they are: one line names it",
    ),
    Setting(
        "model",
        "an LR scheduler stepped each epoch (StepLR) or on a monitored metric (ReduceLROnPlateau)",
        tested_by=("test_randomness.py::test_a_scheduler_continues_exactly_across_a_stop",),
        note="a plateau step Lightning skips across a stop is taken again (not covered: a plateau scheduler "
        "with interval=step)",
    ),
    Setting(
        "model",
        "an LR schedule built from the run's limit (CosineAnnealingLR(T_max=max_epochs), OneCycleLR(total_steps))",
        tested_by=(
            "test_stop_kinds.py::test_a_continued_run_whose_restored_schedule_was_built_for_another_limit_says_so",
            "test_stop_kinds.py::test_a_continued_run_whose_schedule_does_not_depend_on_the_limit_says_nothing",
        ),
        note="continued to the same limit it is exact; to another it follows the first limit's schedule, and one "
        "line at the continue names the scheduler and what to do",
    ),
)


def markdown() -> str:
    """The README's table: one row per setting, ``supported`` or ``refused`` with the start of its line."""
    rows = ["| kind | setting | status | note |", "| --- | --- | --- | --- |"]
    for s in SURFACE:
        status = f"refused: `{s.refused}`" if s.refused else "supported"
        rows.append(f"| {s.kind} | `{s.name}` | {status} | {s.note} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")

"""Runs stopped by a limit and continued, final outputs of the final weights, strict metrics.json, and checkpoint
writes that fail (a full disk). In-process, one process."""

import errno
import json
import warnings

import pytest
from conftest import QUIET, compose_cfg, global_step, max_diff, weights
from lightning.pytorch.plugins.io import TorchCheckpointIO

from dpddp.continuity.io import AtomicCheckpointIO
from dpddp.errors import Preempted, WriteFailed
from dpddp.run.training import train

# 805 training samples / 64 = 12 global batches per epoch
BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]


@pytest.mark.parametrize(
    "first,then",
    [
        (["trainer.max_steps=5"], ["trainer.max_steps=30"]),  # both mid-epoch
        (["trainer.max_steps=17"], ["trainer.max_epochs=4", "trainer.max_steps=-1"]),  # a step limit, then epochs
        (["trainer.max_epochs=2"], ["trainer.max_steps=29"]),  # an epoch limit, then steps
    ],
)
def test_a_run_stopped_by_a_limit_and_continued_equals_a_straight_run(tmp_path, first, then):
    """A checkpoint written at a limit stop resumes in the right place: continuing to a later limit ends with the
    weights and step of a run that went straight there."""
    train(compose_cfg(*BASE, "trainer.max_epochs=4", *first), tmp_path / "first")
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train(compose_cfg(*BASE, "trainer.max_epochs=4", *then, f"ckpt_path={ckpt}"), tmp_path / "continued")
    train(compose_cfg(*BASE, "trainer.max_epochs=4", *then), tmp_path / "straight")
    assert global_step(tmp_path / "continued") == global_step(tmp_path / "straight")
    diff = max_diff(
        weights(tmp_path / "continued/checkpoints/last.ckpt"), weights(tmp_path / "straight/checkpoints/last.ckpt")
    )
    assert diff <= 1e-6


@pytest.mark.parametrize(
    "limit", ["trainer.max_steps=5", "+trainer.val_check_interval=5", "trainer.check_val_every_n_epoch=3"]
)
def test_last_ckpt_and_metrics_are_the_final_weights_whatever_the_validation_schedule(tmp_path, limit):
    """``last.ckpt`` holds the final step; ``val/*`` in metrics.json are the final weights' (a validation of
    ``last.ckpt`` gives the same numbers)."""
    result = train(compose_cfg(*BASE, "trainer.max_epochs=2", limit), tmp_path / "run")
    step = global_step(tmp_path / "run")
    assert step == (5 if "max_steps" in limit else 24)
    again = train(compose_cfg(*BASE, f"ckpt_path={tmp_path / 'run/checkpoints/last.ckpt'}"), tmp_path / "v", "validate")
    assert again["val/loss"] == pytest.approx(result["val/loss"], abs=1e-7)
    assert again["val/acc"] == pytest.approx(result["val/acc"], abs=1e-7)


def test_metrics_json_is_strict_json_with_reasons(tmp_path):
    """Strict JSON: no bare NaN; a value that does not exist is null, and says why."""
    train(compose_cfg(*BASE, "trainer.max_epochs=1", "+trainer.limit_val_batches=0"), tmp_path)
    text = (tmp_path / "metrics.json").read_text()
    written = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert written["val/loss"] is None and written["val/acc"] is None and 0 < written["test/acc"] <= 1
    assert written["missing"]["val/loss"].startswith("no validation ran on the final weights")


def test_a_failed_checkpoint_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    """An I/O error while writing outputs, a full disk mid-write: one line naming the file and directory, no temporary
    file left."""
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "state_dict": {}}, path)
    before = path.read_bytes()

    def full(self, checkpoint, target, storage_options=None):
        open(target, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", full)
    with pytest.raises(WriteFailed) as err:
        io.save_checkpoint({"global_step": 2, "state_dict": {}}, path)
    assert str(err.value) == (
        f"cannot write last.ckpt in {str(tmp_path)!r}: No space left on device: free space or make it writable, then "
        "resume (the earlier last.ckpt is whole)"
    )
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert io.saved_steps == {"last.ckpt": 1}


def test_overfit_batches_is_refused_in_one_line():
    """A pass-through Trainer flag that rebuilds the sampler is refused, naming the flag and what to use instead."""
    from conftest import compose_cfg as cc

    from dpddp.errors import ConfigError
    from dpddp.run.config import check_config

    with pytest.raises(ConfigError) as err:
        check_config(cc("trainer.overfit_batches=2"))
    assert str(err.value) == (
        "trainer.overfit_batches=2 is not offered: Lightning replaces the training sampler for it; use "
        "trainer.limit_train_batches=2 trainer.limit_val_batches=2 instead"
    )


@pytest.mark.parametrize("flag", ["trainer.reload_dataloaders_every_n_epochs=1", "trainer.limit_train_batches=5"])
def test_flags_that_rebuild_or_cut_loaders_keep_exact_resume(tmp_path, flag):
    """Pass-through flags that rebuild or cut loaders: loaders rebuilt every epoch, or cut short, then a stop by
    max_steps and a continuation."""
    train(compose_cfg(*BASE, "trainer.max_epochs=3", flag, "trainer.max_steps=7"), tmp_path / "first")
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train(compose_cfg(*BASE, "trainer.max_epochs=3", flag, f"ckpt_path={ckpt}"), tmp_path / "continued")
    train(compose_cfg(*BASE, "trainer.max_epochs=3", flag), tmp_path / "straight")
    assert global_step(tmp_path / "continued") == global_step(tmp_path / "straight")
    a, b = weights(tmp_path / "continued/checkpoints/last.ckpt"), weights(tmp_path / "straight/checkpoints/last.ckpt")
    assert max_diff(a, b) <= 1e-6


# (accumulate, SIGTERM after batch, optimizer steps at the stop): 12 batches an epoch; the stop comes at the
# first window end (or epoch end) after the batch that sees the signal
@pytest.mark.parametrize("accumulate,at,steps", [(4, 5, 2), (3, 13, 5), (5, 10, 3)])
def test_sigterm_inside_an_accumulation_window_resumes_exactly(tmp_path, accumulate, at, steps):
    """A stop must leave no state outside the checkpoint (an open accumulation window): it lands on an optimizer-step
    boundary, so no summed gradient is lost with .grad."""
    args = [*BASE, "trainer.max_epochs=2", f"trainer.accumulate_grad_batches={accumulate}"]
    kill = ["+callbacks.kill._target_=conftest.SigtermAt", f"+callbacks.kill.at={at}"]
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*args, *kill), tmp_path / "run")
    assert stop.value.step == steps
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    train(compose_cfg(*args, f"ckpt_path={ckpt}"), tmp_path / "resumed")
    train(compose_cfg(*args), tmp_path / "straight")
    a, b = weights(tmp_path / "resumed/checkpoints/last.ckpt"), weights(tmp_path / "straight/checkpoints/last.ckpt")
    assert global_step(tmp_path / "resumed") == global_step(tmp_path / "straight") and max_diff(a, b) <= 1e-6


ES = [
    "+callbacks.early_stopping._target_=lightning.pytorch.callbacks.EarlyStopping",
    "+callbacks.early_stopping.monitor=val/loss",
    "+callbacks.early_stopping.min_delta=0.05",
    "+callbacks.early_stopping.patience=0",
]


def test_a_run_ended_by_early_stopping_stays_ended_when_continued(tmp_path, caplog):
    """Found by the fresh-user trial: continued to a later max_epochs, it trained on; a straight run does not. The
    stop is one log line, with the epoch (from 0, as metrics.csv numbers it) and Lightning's reason."""
    with caplog.at_level("INFO", logger="dpddp.report.epochs"):
        first = train(compose_cfg(*BASE, *ES, "trainer.max_epochs=10"), tmp_path / "first")
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    stopped = global_step(tmp_path / "first")
    assert stopped < 10 * 12 and stopped % 12 == 0  # EarlyStopping ended it, at an epoch's end
    (line,) = [r.getMessage() for r in caplog.records if "EarlyStopping" in r.getMessage()]
    assert line.startswith(
        f"EarlyStopping ended the run after epoch {stopped // 12 - 1}: Monitored metric val/loss did not improve in "
        "the last 1 records. Best score: "
    )
    assert "Signaling" not in line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        continued = train(compose_cfg(*BASE, *ES, "trainer.max_epochs=20", f"ckpt_path={ckpt}"), tmp_path / "continued")
    assert not [str(w.message) for w in caught if "metric contract" in str(w.message)]  # it logs nothing: no step
    assert continued["segments"] == first["segments"] == 1 and continued["train_time_s"] <= first["train_time_s"]
    assert continued["train/loss"] == first["train/loss"]  # the final row's, not null
    train(compose_cfg(*BASE, *ES, "trainer.max_epochs=20"), tmp_path / "straight")
    assert global_step(tmp_path / "continued") == global_step(tmp_path / "straight") == stopped
    a, b = weights(tmp_path / "continued/checkpoints/last.ckpt"), weights(tmp_path / "straight/checkpoints/last.ckpt")
    assert max_diff(a, b) == 0 and continued["val/loss"] == first["val/loss"]


def test_a_stop_by_max_steps_before_any_validation_warns_of_no_missing_metric(tmp_path):
    """The fit ran no validation, so the final weights are validated after it: no "metric contract" warning that
    val/loss is null, since metrics.json has it (found by the fresh-user trial)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(compose_cfg(*BASE, "trainer.max_steps=5"), tmp_path)
    assert not [str(w.message) for w in caught if "metric contract" in str(w.message)]
    assert result["val/loss"] > 0 and result["val/acc"] > 0 and global_step(tmp_path) == 5


def test_fast_dev_run_writes_no_checkpoint(tmp_path):
    """One batch of each stage, then its metrics: no ``checkpoints/`` (a check of the code, not a run to continue);
    ``steps_per_execution=auto`` takes 1 (an execution of K would cut the one step short of its validation)."""
    result = train(compose_cfg(*BASE, "trainer.fast_dev_run=true"), tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["train/loss"] == result["train/loss"] > 0 and result["segments"] == 1
    assert written["val/loss"] > 0 and written["val/acc"] >= 0 and written["test/loss"] > 0 and "missing" not in written
    assert written["steps_per_execution"] == 1


def test_fast_dev_run_with_steps_per_execution_is_one_line():
    from dpddp.errors import ConfigError
    from dpddp.run.config import check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg("trainer.fast_dev_run=true", "steps_per_execution=8"))
    assert str(err.value) == (
        "trainer.fast_dev_run=True cannot be kept with steps_per_execution=8 (it runs one batch of each stage, "
        "not one execution of K): remove it, or use steps_per_execution=1"
    )


@pytest.mark.parametrize(
    "override,line",
    [
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 is invalid: use a positive number"),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1 is invalid: use a non-negative norm"),
    ],
)
def test_trainer_values_lightning_would_crash_on_are_one_line(override, line):
    from dpddp.errors import ConfigError
    from dpddp.run.config import check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(override))
    assert str(err.value).startswith(line)

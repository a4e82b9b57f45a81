"""An evaluation run (eval.py, dpddp-eval): a checkpoint validated and tested exactly on any world size, nothing
trained, metrics.json written; a checkpoint of another model or a weights-only one is one line, exit 2."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import QUIET, ROOT, _entry_here, child_env, cli_here, compose_cfg, leftover, metrics

from dpddp.entry import eval as eval_entry
from dpddp.errors import ConfigError
from dpddp.run.config import check_config
from dpddp.run.training import train

# 1001 samples: the validation and test splits (100 each) do not divide by 3; 48 divides by 2 and 3
DATA = ["accelerator=cpu", "data.num_samples=1001", "data.batch_size=48"]
KEYS = ("val/loss", "val/acc", "test/loss", "test/acc")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained")
    train(compose_cfg(*QUIET, *DATA, "trainer.max_epochs=2"), run)
    return run


def _evaluated(ckpt, out, *overrides):
    return train(compose_cfg(*QUIET, *DATA, f"ckpt_path={ckpt}", *overrides), out, stage="eval")


def test_eval_on_one_process_gives_the_runs_metrics_and_trains_nothing(trained, tmp_path):
    result = _evaluated(trained / "checkpoints/last.ckpt", tmp_path)
    for key in KEYS:
        assert result[key] == pytest.approx(metrics(trained)[key], abs=1e-6), key
    written, ran = metrics(tmp_path), metrics(trained)
    assert written["train/loss"] is None and written["missing"]["train/loss"] == "an eval run: only eval ran"
    # the weights' training, as its checkpoint records it: 1 segment on 1 process
    assert (written["segments"], written["segment_world_sizes"]) == (ran["segments"], ran["segment_world_sizes"])
    assert (written["segments"], written["segment_world_sizes"]) == (1, [1])
    assert not (tmp_path / "checkpoints").exists()  # nothing trained, nothing saved
    assert not (tmp_path / "curves.png").exists()  # no epoch of a fit to draw


@pytest.mark.parametrize("saved", ["lightning", "torch", "other model"])
def test_a_weights_only_or_other_models_checkpoint_is_one_line_exit_2(saved, trained, tmp_path, monkeypatch, capsys):
    """Lightning's ``save_weights_only=True`` (no optimizer or callback states), ``torch.save(state_dict())``, and
    a full checkpoint of the default model given to ``model=mlp``: one line naming ckpt_path, nothing written."""
    full = torch.load(trained / "checkpoints/last.ckpt", weights_only=True)
    kept = ("state_dict", "hyper_parameters", "pytorch-lightning_version", "epoch", "global_step", "loops")
    chosen = {"lightning": {k: full[k] for k in kept}, "torch": full["state_dict"], "other model": full}[saved]
    torch.save(chosen, tmp_path / "w.ckpt")
    model = ["model=mlp"] if saved == "other model" else []
    monkeypatch.chdir(tmp_path)
    run = f"hydra.run.dir={tmp_path / 'run'}"
    monkeypatch.setattr(sys, "argv", ["eval.py", f"ckpt_path={tmp_path / 'w.ckpt'}", *DATA, *model, run])
    with pytest.raises(SystemExit) as ended:
        eval_entry.main()
    said = {
        "lightning": "holds the model's weights only (no optimizer_states or callback states: saved with "
        "weights_only=True), so eval.py cannot restore the run it came from: give a full checkpoint (its run's "
        "checkpoints/last.ckpt)",
        "torch": "is a bare state dict (weights only: torch.save(model.state_dict())), not a Lightning checkpoint: "
        "give its run's checkpoints/last.ckpt, or load the weights into the model yourself and start without ckpt_path",
        "other model": "holds another model's weights (no net.0.weight",
    }[saved]
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: ckpt_path={str(tmp_path / 'w.ckpt')!r} {said}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.ckpt"]  # no run directory, nothing written


def test_another_models_checkpoint_and_no_checkpoint_are_one_line_and_help(trained, monkeypatch, capsys):
    cfg = compose_cfg(*DATA, "model=mlp", f"ckpt_path={trained / 'checkpoints/last.ckpt'}")
    with pytest.raises(ConfigError, match="^ckpt_path=.* holds another model's weights \\(no net.0.weight"):
        check_config(cfg, "eval")
    monkeypatch.setattr(sys, "argv", ["dpddp-eval", "--help"])
    with pytest.raises(SystemExit) as ended:
        eval_entry.main()
    assert ended.value.code == 0 and capsys.readouterr().out.startswith("usage: python eval.py ckpt_path=<")
    monkeypatch.setattr(sys, "argv", ["eval.py", "accelerator=cpu"])
    with pytest.raises(SystemExit) as ended:
        eval_entry.main()
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        "error: ckpt_path is missing: python eval.py ckpt_path=<a run's checkpoints/last.ckpt> [key=value ...]\n"
    )


@pytest.mark.slow
def test_eval_py_and_dpddp_eval_on_one_and_three_processes_give_the_runs_test_metrics(trained, tmp_path, monkeypatch):
    """eval.py's own file run in this process (``runpy``: its ``__main__`` block, one process) and the dpddp-eval
    console script on 3 ddp processes."""
    ckpt = trained / "checkpoints/last.ckpt"
    args = [f"ckpt_path={ckpt}", *DATA, *QUIET]
    with _entry_here(tmp_path, monkeypatch, ["eval.py", *args, f"hydra.run.dir={tmp_path / 'one'}"]) as status:
        runpy.run_path(str(ROOT / "eval.py"), run_name="__main__")
    assert status == [0]
    env, tag = child_env()
    cmd = [str(Path(sys.executable).parent / "dpddp-eval"), *args, "strategy=ddp", "devices=3"]  # the console script
    cmd.append(f"hydra.run.dir={tmp_path / 'three'}")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(tag) == []
    for name, world in (("one", 1), ("three", 3)):
        assert metrics(tmp_path / name)["world_size"] == world
        assert metrics(tmp_path / name)["segment_world_sizes"] == [1]  # the weights' training, not this world
        for key in KEYS:
            assert metrics(tmp_path / name)[key] == pytest.approx(metrics(trained)[key], abs=1e-6), (name, key)


def test_eval_s_unknown_key_is_train_py_s_line(tmp_path, monkeypatch, capsys):
    """An override of a key the config lacks: the line train.py gives (was omegaconf's traceback, exit 1)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["eval.py", f"ckpt_path={tmp_path / 'last.ckpt'}", "devises=2"])
    with pytest.raises(SystemExit) as ended:
        eval_entry.main()
    assert ended.value.code == 2 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == "error: devises=2: the config has no key devises: did you mean devices?\n"


def test_eval_on_other_data_than_the_runs_is_one_line_naming_the_fix(trained, tmp_path, monkeypatch, capsys):
    """The checkpoint's ``datamodule_hyper_parameters`` (or, without them, its run's ``.hydra/config.yaml``) say
    the run's data: an evaluation on other samples or splits is refused, nothing written."""
    ckpt = trained / "checkpoints/last.ckpt"
    monkeypatch.chdir(tmp_path)
    data = ["accelerator=cpu", "data.batch_size=48"]  # data.num_samples: the default 4096
    monkeypatch.setattr(sys, "argv", ["eval.py", f"ckpt_path={ckpt}", *data, f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as ended:
        eval_entry.main()
    assert ended.value.code == 2 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == (
        f"error: ckpt_path={str(ckpt)!r} was trained with other data: data.num_samples=4096 (was 1001): evaluate "
        "it on the run's data: data.num_samples=1001\n"
    )
    bare = {k: v for k, v in torch.load(ckpt, weights_only=True).items() if k != "datamodule_hyper_parameters"}
    (tmp_path / "old/checkpoints").mkdir(parents=True)
    torch.save(bare, tmp_path / "old/checkpoints/last.ckpt")
    (tmp_path / "old/.hydra").mkdir()
    (tmp_path / "old/.hydra/config.yaml").write_text("seed: 5\ndata:\n  num_samples: 1001\n  seed: ${seed}\n")
    cfg = compose_cfg(*DATA, f"ckpt_path={tmp_path / 'old/checkpoints/last.ckpt'}", "data.batch_size=16")
    with pytest.raises(ConfigError, match=r"other data: data.seed=0 \(was 5\): evaluate it on the run's data: data"):
        check_config(cfg, "eval")


def test_a_directory_as_ckpt_path_is_one_line_naming_the_file_inside(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    said = {
        trained: f"give ckpt_path={trained / 'checkpoints/last.ckpt'}",
        trained / "checkpoints": f"give ckpt_path={trained / 'checkpoints/last.ckpt'}",
        tmp_path: "give a checkpoint file, e.g. <run dir>/checkpoints/last.ckpt",
    }
    for given, instead in said.items():
        monkeypatch.setattr(sys, "argv", ["eval.py", f"ckpt_path={given}", *DATA, f"hydra.run.dir={tmp_path / 'r'}"])
        with pytest.raises(SystemExit) as ended:
            eval_entry.main()
        assert ended.value.code == 2 and list(tmp_path.iterdir()) == []
        line = f"error: ckpt_path={str(given)!r} is a directory, not a checkpoint file: {instead}\n"
        assert capsys.readouterr().err == line


def test_a_trainer_limit_below_the_checkpoint_s_epochs_does_not_refuse_an_evaluation(trained, tmp_path, monkeypatch):
    """eval.py, ``dpddp test`` and ``dpddp validate`` train nothing: ``trainer.max_epochs=1`` under the checkpoint's
    2 finished epochs evaluates it (was refused, exit 2); a fit from it is still refused in one line."""
    ckpt = trained / "checkpoints/last.ckpt"
    args = ["eval.py", f"ckpt_path={ckpt}", *DATA, *QUIET, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'e'}"]
    with _entry_here(tmp_path, monkeypatch, args) as status:
        eval_entry.main()
    assert status == [0] and metrics(tmp_path / "e")["test/acc"] == pytest.approx(metrics(trained)["test/acc"])
    given = ["--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--data.num_samples=1001", f"--ckpt_path={ckpt}"]
    for stage in ("test", "validate"):
        root = f"--trainer.default_root_dir={tmp_path / stage}"
        assert cli_here(stage, *given, root, cwd=tmp_path, monkeypatch=monkeypatch) == 0, stage
    with pytest.raises(ConfigError, match=re.escape("has finished 2 epochs, more than trainer.max_epochs=1: raise")):
        check_config(compose_cfg(*DATA, "trainer.max_epochs=1", f"ckpt_path={ckpt}"), "fit")
    with pytest.raises(ConfigError, match=r"other data: data.num_samples=4096 \(was 1001\)"):  # no longer hidden
        check_config(compose_cfg("data.batch_size=48", "trainer.max_epochs=1", f"ckpt_path={ckpt}"), "eval")

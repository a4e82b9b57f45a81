"""A user's own model and data set, written outside the package as a user would (the template in docs/), trained
through train.py with _target_ overrides; the bundled tables; the installed commands from a directory of the user's,
stopped and continued by the command they print."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from conftest import QUIET, ROOT, _entry_here, child_env, compose_cfg, leftover, made_once, metrics, run_project

from dpddp.entry import hydra as hydra_entry
from dpddp.entry.lightning_cli import main as cli_main
from dpddp.run.training import train

pytestmark = pytest.mark.slow

MINE = '''
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from dpddp.data.global_batch import GlobalBatchDataModule


class Blobs(Dataset):
    """Gaussian blobs around random centres: one (x [num_features], y) sample per index."""

    def __init__(self, num_samples: int = 1013, num_features: int = 8, num_classes: int = 3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        centres = 2 * torch.randn(num_classes, num_features, generator=g)
        self.y = torch.randint(0, num_classes, (num_samples,), generator=g)
        self.x = centres[self.y] + torch.randn(num_samples, num_features, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class TwoLayerNet(pl.LightningModule):
    """Two layers; metrics as torchmetrics objects (synced sums and counts), logged per epoch."""

    def __init__(self, num_features: int = 8, num_classes: int = 3, hidden: int = 32, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(num_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_classes)
        )
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.train_loss.update(loss.detach(), weight=len(y))
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch, stage):
        x, y = batch
        logits = self(x)
        loss, acc = getattr(self, f"{stage}_loss"), getattr(self, f"{stage}_acc")
        loss.update(F.cross_entropy(logits, y, reduction="none"))  # per sample: an empty chunk adds nothing
        if len(y):
            acc.update(logits, y)
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True)
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class BlobsData(GlobalBatchDataModule):
    """The blobs in global batches: a data module of the user's own (what data=dataset builds for Blobs)."""

    def __init__(self, num_samples: int = 1013, batch_size: int = 64, seed: int = 0):
        super().__init__(batch_size=batch_size, seed=seed)
        self.num_samples = num_samples

    def make_dataset(self):
        return Blobs(self.num_samples)
'''

MY_NET_YAML = """_target_: mine.TwoLayerNet
num_features: 8
num_classes: 3
hidden: 32
lr: 0.05
"""

USER_ARGS = ["--config-dir", "conf", "model=my_net", "data=dataset", "+data.dataset._target_=mine.Blobs"]
USER_ARGS += ["data.batch_size=32", "trainer.max_epochs=3", "accelerator=cpu", *QUIET]
DDP = ["strategy=ddp", "devices=2"]


def _project(path: Path) -> Path:
    shutil.copy(ROOT / "train.py", path / "train.py")
    (path / "mine.py").write_text(MINE)
    (path / "conf/model").mkdir(parents=True)
    (path / "conf/model/my_net.yaml").write_text(MY_NET_YAML)
    return path


def train_here(project: Path, args: list[str], run: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``python train.py ARGS`` of ``project`` (``ARGS``: ``--config-dir conf`` first, as ``USER_ARGS``) trained in
    this process (``train`` on the composed config: what train.py runs) into ``project/run``; the project's modules
    are dropped from ``sys.modules`` after. Returns the run directory."""
    assert args[:2] == ["--config-dir", "conf"]
    monkeypatch.syspath_prepend(str(project))
    try:
        train(compose_cfg(*args[2:], f"hydra.searchpath=[file://{project / 'conf'}]"), project / run)
    finally:
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(project)):
                del sys.modules[name]
    return project / run


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The user's project: their copy of train.py, ``mine.py`` and ``conf/model/my_net.yaml``."""
    return _project(tmp_path)


@pytest.fixture
def one_process(shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's model and data trained on one process (``USER_ARGS``, in this process: ``train_here``), once a
    session: the run directory that the 2-process run and the stopped-and-resumed run are compared to."""

    def make(path: Path) -> None:
        path.mkdir()
        train_here(_project(path), USER_ARGS, "one", monkeypatch)

    return made_once(shared_dir, "users_model_one_process", make) / "one"


def _weights(run: Path, prefix: str) -> dict[str, torch.Tensor]:
    state = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def _close(a: dict, b: dict, tol: float) -> bool:
    return a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= tol for k in a)


def test_a_users_model_and_dataset_train_the_same_on_one_and_two_processes(project, one_process):
    run_project(project, *USER_ARGS, *DDP, "hydra.run.dir=two", check=True)
    one, two = metrics(one_process), metrics(project / "two")
    assert two["world_size"] == 2 and one["val/acc"] > 0.9
    assert _close(_weights(one_process, "net."), _weights(project / "two", "net."), 1e-5)
    # 1013 samples: val and test hold 101 each, an odd size that splits unevenly over 2 ranks
    for key in ("val/loss", "val/acc", "test/loss", "test/acc", "train/loss"):
        assert abs(one[key] - two[key]) <= 1e-5, key


def test_the_lightning_cli_takes_a_users_model_and_data_module_and_equals_the_hydra_entry(project, one_process):
    """``dpddp fit --model=<user class> --data=<user class>`` (LightningCLI's subclass mode) on 2 ddp processes:
    the Hydra entry's weights and metrics (its one-process run of the same model and data)."""
    command = [str(Path(sys.executable).parent / "dpddp"), "fit", "--model=mine.TwoLayerNet", "--data=mine.BlobsData"]
    args = ["--data.batch_size=32", "--trainer.max_epochs=3", "--trainer.accelerator=cpu"]
    args += ["--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.enable_progress_bar=false"]
    run_project(project, *args, "--trainer.default_root_dir=cli", command=command, check=True)
    run = project / "cli/lightning_logs/version_0"
    assert "class_path: mine.TwoLayerNet" in (run / "config.yaml").read_text()
    assert metrics(run)["world_size"] == 2
    assert _close(_weights(run, "net."), _weights(one_process, "net."), 1e-6)
    for key in ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert abs(metrics(run)[key] - metrics(one_process)[key]) <= 1e-6, key


def test_digits_with_the_mlp_reaches_095_on_one_and_two_processes(tmp_path):
    args = ["data=digits", "model=mlp", "accelerator=cpu", *QUIET]
    train(compose_cfg(*args, "logger=none"), tmp_path / "one")  # what train.py runs, in process
    run_project(
        tmp_path, *args, *DDP, "hydra.run.dir=two", command=[sys.executable, str(ROOT / "train.py")], check=True
    )
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert one["test/acc"] >= 0.95 and two["test/acc"] >= 0.95
    for key in ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert abs(one[key] - two[key]) <= 1e-5, key


BIN = Path(sys.executable).parent  # dpddp-train and dpddp, installed next to this Python
KILL = ["+callbacks.kill._target_=conftest.SigtermAtStep", "+callbacks.kill.step=37"]  # in epoch 1 of 3


def _env(cwd: Path) -> tuple[dict[str, str], str]:
    """A user's shell in ``cwd``: the project and tests/ (conftest.SigtermAtStep) on PYTHONPATH, BIN on PATH."""
    env, tag = child_env(PYTHONPATH=os.pathsep.join([str(cwd), str(ROOT / "tests")]))
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    return env, tag


def _pasted(cwd: Path, stderr: str, stop_line: str) -> str:
    """The command the one ``stop_line`` of ``stderr`` prints after ``resume with``, pasted into a shell in ``cwd``
    as it is (``_env``): it exits 0 and leaves no process. Returns it."""
    (line,) = [x for x in stderr.splitlines() if x.startswith(stop_line)]
    pasted = line.split("resume with ", 1)[1]
    env, tag = _env(cwd)
    resumed = subprocess.run(pasted, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, pasted + "\n" + resumed.stderr[-3000:]
    assert leftover(tag) == []
    return pasted


def _stopped_here_then_pasted(cwd: Path, command: list[str], main, stop_line: str, monkeypatch, capfd) -> str:
    """``command`` stopped by a SIGTERM in this process (exit 143, no process left), then ``_pasted``; returns the
    pasted command. The run is ``main``, the installed command's function, with ``sys.argv`` the command (its
    program from BIN) and ``cwd`` on ``sys.path`` (the project's modules dropped after): the stop is not about the
    process, its status is main's SystemExit and its line from stderr."""
    monkeypatch.syspath_prepend(str(cwd))
    children = set(psutil.Process().children(recursive=True))  # an earlier test's loader fork server stays
    try:
        with _entry_here(cwd, monkeypatch, [str(BIN / command[0]), *command[1:]]) as status:
            main()
    finally:
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(cwd)):
                del sys.modules[name]
    err = capfd.readouterr().err
    assert status == [143], err[-3000:]
    assert set(psutil.Process().children(recursive=True)) <= children  # none of the run's left
    return _pasted(cwd, err, stop_line)


@pytest.fixture
def bare_project(tmp_path: Path) -> Path:
    """The user's project as docs/your-model-and-data.md has it, without a train.py: ``mine.py`` and
    ``conf/model/my_net.yaml``."""
    _project(tmp_path)
    (tmp_path / "train.py").unlink()
    return tmp_path


def test_the_printed_resume_command_of_the_installed_command_continues_to_the_straight_run(
    bare_project, one_process, monkeypatch, capfd
):
    """``dpddp-train --config-dir conf model=my_net ...`` stopped by SIGTERM mid-epoch (815 training samples / 32
    = 25 batches an epoch; step 38 is in epoch 1) in a project without train.py: the printed line, pasted, runs
    and ends with the uninterrupted run's weights. The pasted command is the installed command trained from a
    directory that is not the repository's (its outputs whole: metrics.json, last.ckpt); the stopped run is its
    function in this process."""
    command = ["dpddp-train", *USER_ARGS, *KILL, "hydra.run.dir=run"]
    stop = "error: stopped by SIGTERM after step"
    pasted = _stopped_here_then_pasted(bare_project, command, hydra_entry.main, stop, monkeypatch, capfd)
    assert pasted.startswith("dpddp-train --config-dir conf model=my_net ")
    assert shutil.which("dpddp-train", path=str(BIN)), "dpddp-train is not installed next to this Python"
    assert metrics(bare_project / "run")["val/acc"] > 0.9 and (bare_project / "run/checkpoints/last.ckpt").is_file()
    assert _close(_weights(bare_project / "run", "net."), _weights(one_process, "net."), 1e-6)


def test_the_printed_resume_command_of_a_sweep_continues_its_job_to_the_straight_run(
    bare_project, one_process, monkeypatch, capfd
):
    """The same for a sweep of the installed command (``-m``; its job 0 is ``one_process``'s run, seed 0), stopped
    in this process (``SigtermSweepAt`` signals the topmost process of the test's tag: this one)."""
    kill = ["+callbacks.stop._target_=conftest.SigtermSweepAt", "+callbacks.stop.step=37"]
    command = ["dpddp-train", "-m", *USER_ARGS, *kill, "seed=0", "hydra.sweep.dir=sweep"]
    monkeypatch.setenv("DPDDP_TEST_TAG", child_env()[1])
    stop = "error: the sweep was stopped by SIGTERM"
    pasted = _stopped_here_then_pasted(bare_project, command, hydra_entry.main, stop, monkeypatch, capfd)
    assert pasted.startswith("dpddp-train -m --config-dir conf model=my_net ")
    assert _close(_weights(bare_project / "sweep/0", "net."), _weights(one_process, "net."), 1e-6)


def test_the_printed_resume_command_of_the_lightning_cli_continues_to_the_straight_run(
    bare_project, one_process, monkeypatch, capfd
):
    """The same for ``dpddp fit --model=mine.TwoLayerNet --data=mine.BlobsData`` on one process (stopped in this
    process, pasted in a shell)."""
    command = ["dpddp", "fit", "--model=mine.TwoLayerNet", "--data=mine.BlobsData", "--data.batch_size=32"]
    command += ["--trainer.max_epochs=3", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false"]
    command += ["--trainer.callbacks+=conftest.SigtermAtStep", "--trainer.callbacks.step=37"]
    stop = "error: stopped by SIGTERM after step"
    pasted = _stopped_here_then_pasted(bare_project, command, cli_main, stop, monkeypatch, capfd)
    assert pasted.startswith("dpddp fit --model=mine.TwoLayerNet ") and pasted.endswith("--ckpt_path=last")
    run = bare_project / "lightning_logs/version_0"
    assert [p.name for p in sorted(run.glob("config*.yaml"))] == ["config-1.yaml", "config.yaml"]  # one run
    assert _close(_weights(run, "net."), _weights(one_process, "net."), 1e-6)

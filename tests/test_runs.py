"""Real runs of train.py in subprocesses: one process, DDP with 2 gloo processes, resume, bad input."""

import pytest
import torch
from conftest import QUIET, compose_cfg, leftover, max_diff, metrics, run_train, train_py_here, weights

from dpddp.run.training import train

pytestmark = pytest.mark.slow
EVAL = ("val/loss", "val/acc", "test/loss", "test/acc")


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(proc.tag) == []


@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_ddp_two_processes_equal_one_process(tmp_path, launch):
    """Evaluation counting padded samples, data differing between ranks, code after fit on every rank, a batch size
    whose meaning changes with the world size: odd split sizes, same data on every rank, one writer, global batch; rank
    1 forked (the CPU default) or started as ``python -m dpddp.parallel.rank`` (what GPUs use)."""
    common = ["accelerator=cpu", "data.num_samples=1005", "seed=2", "trainer.max_epochs=3", "data.batch_size=32"]
    train(compose_cfg(*common, *QUIET, "logger=none"), tmp_path / "single")  # what train.py runs, in process
    ddp_args = ["strategy=ddp", "devices=2", f"strategy.launch={launch}", "predict=true", "hydra.run.dir=ddp"]
    ddp = run_train(*common, *ddp_args, cwd=tmp_path)
    _ok(ddp)
    how = {"fork": "local ranks 1-1 forked", "exec": "local ranks 1-1 started with python -m dpddp.parallel.rank"}[
        launch
    ]
    assert how in (tmp_path / "ddp" / "train.log").read_text()
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "ddp")
    assert two["world_size"] == 2 and two["strategy"] == "ddp" and two["val/acc"] >= 0.9
    for key in EVAL:  # every sample counted once: val split 100 and test split 100 over 2 ranks, batch 32
        assert two[key] == pytest.approx(one[key], abs=1e-6), key
    ckpts = [tmp_path / d / "checkpoints" / "last.ckpt" for d in ("single", "ddp")]
    assert max_diff(weights(ckpts[0]), weights(ckpts[1])) <= 1e-5
    steps = [torch.load(c, weights_only=True)["global_step"] for c in ckpts]
    assert steps == [3 * (805 // 32)] * 2  # the same optimizer steps per epoch on 1 and 2 processes
    # the same data on both ranks
    sums = [
        line.split("data checksum ")[1].split()[0]
        for f in ("train.log", "rank1.log")
        for line in (tmp_path / "ddp" / f).read_text().splitlines()
        if "data checksum" in line
    ]
    assert len(sums) >= 2 and len(set(sums)) == 1
    # rank 0 alone writes results
    assert [p.name for p in tmp_path.glob("ddp/**/metrics.json")] == ["metrics.json"]
    assert len(list(tmp_path.glob("ddp/**/.hydra"))) == 1
    assert (ddp.stdout + ddp.stderr).count("metrics: train/loss=") == 1
    # predictions gathered from both ranks: every test sample once, by its row in the data set (the last 100)
    rows = (tmp_path / "ddp" / "predictions.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(905, 1005))


def test_resume_from_relative_path_on_one_and_two_devices(tmp_path, monkeypatch):
    """A relative path resolved against a changed working directory: ckpt_path relative to where the command ran, also
    with hydra.job.chdir=true (train.py's calls in this process) and on 2 devices."""
    common = ["accelerator=cpu", "data.num_samples=1005", "model.optimizer=adam", "model.lr=0.01"]
    train(compose_cfg(*common, *QUIET, "trainer.max_epochs=4", "logger=none"), tmp_path / "runs/straight")
    train(compose_cfg(*common, *QUIET, "trainer.max_epochs=2", "logger=none"), tmp_path / "runs/a")
    resume = [*common, "trainer.max_epochs=4", "ckpt_path=runs/a/checkpoints/last.ckpt", "hydra.job.chdir=true"]
    assert train_py_here(*resume, "hydra.run.dir=runs/b", cwd=tmp_path, monkeypatch=monkeypatch) == 0
    _ok(run_train(*resume, "strategy=ddp", "devices=2", "hydra.run.dir=runs/c", cwd=tmp_path))
    straight = tmp_path / "runs/straight/checkpoints/last.ckpt"
    for run, tol in (("b", 1e-6), ("c", 1e-5)):
        ckpt = tmp_path / "runs" / run / "checkpoints" / "last.ckpt"
        assert torch.load(ckpt, weights_only=True)["global_step"] == 4 * (805 // 64)
        assert max_diff(weights(straight), weights(ckpt)) <= tol, run


BAD = [
    (["+devises=2"], "unknown setting devises: did you mean devices?"),
    (["strategy=dp", "accelerator=cpu", "devices=2"], "use strategy=ddp devices=2"),
    # (a global batch the world size does not divide: the dp row's path, a config check's refusal at start; its line
    # in test_config.py and test_cli.py)
    (["ckpt_path=missing.ckpt"], "missing.ckpt' does not exist"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[a[-1] for a, _ in BAD])
def test_bad_input_exits_with_one_line(tmp_path, args, message, monkeypatch, capfd):
    """train.py's calls in this process: exit 2, one ``error:`` line, no traceback, nothing written."""
    assert train_py_here(*args, "hydra.run.dir=bad", cwd=tmp_path, monkeypatch=monkeypatch) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in err
    assert not (tmp_path / "bad" / "checkpoints").exists() and not (tmp_path / "bad" / "metrics.json").exists()


def test_multirun_over_devices_launches_each_jobs_own_ranks(tmp_path):
    """DDP ranks replaying a Hydra sweep, rank state leaking between jobs: one sweep dir, each job its own world size
    and its own directory, metrics of a single run. devices=2,1,2: a first job's ranks (the sweep's process fresh),
    a one-process job after a ddp job, and ranks started after a one-process job, in one sweep."""
    order = [2, 1, 2]
    args = ["-m", "strategy=ddp", "accelerator=cpu", "devices=2,1,2", "data.num_samples=606"]
    proc = run_train(*args, "trainer.max_epochs=2", "hydra.sweep.dir=sweep", cwd=tmp_path)
    _ok(proc)
    jobs = [metrics(tmp_path / "sweep" / str(i)) for i in range(len(order))]
    assert [j["world_size"] for j in jobs] == [j["devices"] for j in jobs] == order
    for job in jobs[1:]:
        for key in EVAL:
            assert job[key] == pytest.approx(jobs[0][key], abs=1e-6)
    assert [(tmp_path / "sweep" / str(i) / "rank1.log").is_file() for i in range(len(order))] == [True, False, True]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("**/multirun.yaml")) == [
        "sweep/multirun.yaml"
    ]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_streaming_ddp_equals_one_process_and_learns(tmp_path):
    """Streaming data: the same samples and order on 1 and 2 processes (block shuffle), and the task is learnt."""
    common = ["accelerator=cpu", "data.streaming=true", "data.num_samples=20000", "trainer.max_epochs=2"]
    train(compose_cfg(*common, *QUIET, "logger=none"), tmp_path / "single")
    ddp = run_train(*common, "strategy=ddp", "devices=2", "hydra.run.dir=ddp", cwd=tmp_path)
    _ok(ddp)
    one, two = metrics(tmp_path / "single"), metrics(tmp_path / "ddp")
    assert two["world_size"] == 2 and two["val/acc"] >= 0.9
    for key in EVAL:
        assert two[key] == pytest.approx(one[key], abs=1e-5), key
    ckpts = [tmp_path / d / "checkpoints" / "last.ckpt" for d in ("single", "ddp")]
    assert max_diff(weights(ckpts[0]), weights(ckpts[1])) <= 1e-5

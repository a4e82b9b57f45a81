"""MLflow and W&B under DDP and sweeps: one tracker run per dpddp run (global rank 0 opens it), the same run
continued by resume=true and by a sweep's resume with each epoch logged once, a sweep's jobs in one experiment
(one W&B group), named and tagged with the job number and overrides, the config as parameters. MLflow is read
with its own client from the default SQLite store, W&B from its offline run files."""

from __future__ import annotations

import csv
import json
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QUIET, ROOT, child_env, compose_cfg, leftover, run_train, train_py_here, unset
from hydra.errors import InstantiationException

from dpddp.errors import ConfigError
from dpddp.report.trackers import check_file_stores, kept_ids
from dpddp.run.build import build_error

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

ARGS = ["accelerator=cpu", "data.num_samples=1005"]


def _client(cwd: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")


def _runs(client: MlflowClient) -> dict[str, list]:
    """The runs by experiment name (experiments with runs only)."""
    found = {e.name: client.search_runs([e.experiment_id]) for e in client.search_experiments()}
    return {name: runs for name, runs in found.items() if runs}


def _val_acc(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(r["val/acc"]) for r in csv.DictReader(f) if r["stage"] == "fit"]


def _wandb_records(path: Path):
    """The records of a W&B ``.wandb`` file: a 7-byte header, then LevelDB log blocks of protobuf ``Record``s."""
    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7]) if left >= 7 else (0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _wandb_runs(run_dir: Path) -> tuple[set[str], set[str], list[tuple[int, float]]]:
    """Ids and groups of the offline W&B runs under ``run_dir``, and their (epoch, val/acc) history, in order."""
    ids, groups, history = set(), set(), []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                groups.add(record.run.run_group)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "val/acc" in items:
                    history.append((int(items["epoch"]), items["val/acc"]))
    return ids, groups, history


@pytest.mark.slow
def test_mlflow_and_wandb_on_ddp_give_one_run_each_continued_by_resume(tmp_path):
    """ddp(2), 2 epochs, then resume=true to 3: one MLflow run (in experiment dpddp, named by the run directory),
    its val/acc the epoch table's, epochs 0..2 once each, the config as parameters; one W&B id across the two
    invocations' offline files, epochs 0..2 once each; no process left. A callback that needs a logger
    (LearningRateMonitor) runs on every rank (rank 1 has no tracker of its own) and logs into rank 0's. Its first
    invocation starts at once with two single MLflow runs in the same directory, on a store that does not exist
    yet (case 53's kind outside a sweep: unlocked, all but one failed migrating it, ``table metrics already
    exists``): each opens it, one tracker run each."""
    lr = "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"
    run = ["logger=mlflow_wandb", "strategy=ddp", "devices=2", "hydra.run.dir=outputs/run", lr]
    singles = [[*ARGS, "trainer.max_epochs=1", "logger=mlflow", f"hydra.run.dir=outputs/run{i}"] for i in (1, 2)]
    env, tag = child_env()
    procs = []
    for i, args in enumerate([[*ARGS, *run, "trainer.max_epochs=2"], *singles]):
        with open(tmp_path / f"stderr{i}.txt", "w") as err:
            cmd = [sys.executable, str(ROOT / "train.py"), *args, *unset(QUIET, args)]
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err))
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0, 0], [(tmp_path / f"stderr{i}.txt").read_text()[-1500:] for i in range(3)]
    again = run_train(*ARGS, *run, "trainer.max_epochs=3", "resume=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert leftover(tag) == [] and leftover(again.tag) == []
    run_dir = tmp_path / "outputs/run"
    client = _client(tmp_path)
    runs = _runs(client)
    assert list(runs) == ["dpddp"] and len(runs["dpddp"]) == 3  # one experiment, one tracker run per run
    by_dir = {r.data.tags["dpddp.run_dir"]: r for r in runs["dpddp"]}
    assert sorted(Path(d).name for d in by_dir) == ["run", "run1", "run2"]
    tracked = by_dir[str(run_dir)]
    rates = client.get_metric_history(tracked.info.run_id, "lr-SGD")
    assert rates and {m.value for m in rates} == {0.1}  # the packaged model's learning rate
    history = client.get_metric_history(tracked.info.run_id, "val/acc")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(_val_acc(run_dir), abs=1e-7)
    assert len(history) == 3 == len({m.step for m in history})
    assert tracked.info.run_name == "outputs/run" and tracked.data.tags["dpddp.run_dir"] == str(run_dir)
    assert tracked.data.params["strategy.name"] == "ddp" and tracked.data.params["devices"] == "2"
    assert tracked.data.params["trainer.max_epochs"] == "2"  # the config of the invocation that opened it
    kept = json.loads((run_dir / "trackers.json").read_text())
    assert kept["mlflow"]["run_id"] == tracked.info.run_id
    ids, groups, wandb_history = _wandb_runs(run_dir)
    assert ids == {kept["wandb"]["id"]} and groups == {"dpddp"}
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 2  # one per invocation, the same run id
    assert [e for e, _ in wandb_history] == [0, 1, 2]
    assert [v for _, v in wandb_history] == pytest.approx(_val_acc(run_dir), abs=1e-7)


@pytest.mark.slow
def test_a_sweep_gives_one_run_per_job_in_one_experiment_and_its_resume_continues_them(tmp_path, monkeypatch):
    """A 2-job sweep (seed=0,1) with MLflow and W&B, its jobs in parallel (the joblib launcher's 2 workers) on a
    store that does not exist yet, then the same sweep to 2 epochs: 2 finished MLflow runs in one experiment named
    for the sweep (case 53: the workers made and migrated the store at once, and jobs failed; the sweep's process
    makes it first), named and tagged with the job number and overrides, each with val/acc for epochs 0 and 1
    once; 2 W&B ids in one group. The resume runs in this process (basic launcher): a job's own directory decides
    its continue, whatever the launcher."""
    sweep = ["-m", "logger=mlflow_wandb", "seed=0,1", "hydra.sweep.dir=multirun/s", *ARGS]
    joblib = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    proc = run_train(*sweep, *joblib, "trainer.max_epochs=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(proc.tag) == []
    try:
        assert train_py_here(*sweep, "trainer.max_epochs=2", cwd=tmp_path, monkeypatch=monkeypatch) == 0
    finally:
        wandb.teardown()  # the W&B service this process started
    client = _client(tmp_path)
    runs = _runs(client)
    assert list(runs) == ["dpddp sweep multirun/s"]
    by_job = {r.data.tags["dpddp.job"]: r for r in runs["dpddp sweep multirun/s"]}
    assert sorted(by_job) == ["0", "1"] and {r.info.status for r in by_job.values()} == {"FINISHED"}
    for job, tracked in by_job.items():
        assert tracked.info.run_name.startswith(f"job {job}: ") and f"seed={job}" in tracked.info.run_name
        assert f"seed={job}" in tracked.data.tags["dpddp.overrides"] and tracked.data.params["seed"] == job
        history = client.get_metric_history(tracked.info.run_id, "val/acc")
        job_dir = tmp_path / "multirun/s" / job
        assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(_val_acc(job_dir), abs=1e-7)
        assert len(history) == 2
    found = [_wandb_runs(tmp_path / "multirun/s" / job) for job in ("0", "1")]
    assert len(found[0][0] | found[1][0]) == 2 and found[0][1] == found[1][1] == {"dpddp sweep multirun/s"}
    assert [[e for e, _ in history] for _, _, history in found] == [[0, 1], [0, 1]]


def test_a_trackers_own_failure_is_named_as_the_trackers():
    """MLflow's store failing as the logger is built (parallel jobs migrating one SQLite store at once: case 53)
    is the tracker's failure, not the arguments of its class."""
    spec = compose_cfg("logger=mlflow").logger
    err = InstantiationException("Error in call to target 'lightning.pytorch.loggers.mlflow.MLFlowLogger'")
    err.__cause__ = sqlite3.OperationalError("table secrets already exists")
    assert str(build_error(spec, "logger", err)) == (
        "logger (lightning.pytorch.loggers.MLFlowLogger): MLflow itself failed (OperationalError: table secrets "
        "already exists), not its arguments: check logger.tracking_uri"
    )


@pytest.fixture
def refused_file_stores(tmp_path_factory, monkeypatch):
    """MLflow 3.17 refuses file stores; 2.x (which dpddp also takes) opens them."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    try:
        MlflowClient(str(tmp_path_factory.mktemp("probe") / "mlruns"))
    except mlflow.exceptions.MlflowException:
        return
    pytest.skip(f"MLflow {mlflow.__version__} opens file stores")


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_an_mlflow_file_store_mlflow_refuses_is_one_line_before_anything_is_written(
    tmp_path, mode, refused_file_stores, monkeypatch, capfd
):
    """MLflow 3 refuses a file store (``tracking_uri`` a path or ``file:``) unless ``MLFLOW_ALLOW_FILE_STORE=true``:
    one line with MLflow's way out, exit 2, before the run's or sweep's directory and any job (each job failed).
    train.py's calls in this process."""
    uri = f"file://{tmp_path / 'mlruns'}" if mode == "run" else str(tmp_path / "mlruns")
    where = f"hydra.run.dir={tmp_path / 'run'}" if mode == "run" else f"hydra.sweep.dir={tmp_path / 'run'}"
    sweep = ["-m", "seed=0,1"] if mode == "sweep" else []
    code = train_py_here(
        *sweep, *ARGS, "logger=mlflow", f"logger.tracking_uri={uri}", where, cwd=tmp_path, monkeypatch=monkeypatch
    )
    assert code == 2
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"error: logger.tracking_uri={uri!r}: MLflow refuses this file store (MlflowException")
    assert line.endswith("or set MLFLOW_ALLOW_FILE_STORE=true as MLflow says")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_mlflow_file_store_opens_where_mlflow_allows_it(tmp_path, monkeypatch, refused_file_stores):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_file_stores([compose_cfg("logger=mlflow", f"logger.tracking_uri={tmp_path / 'mlruns'}")])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(ConfigError, match="MLflow refuses this file store"):
        check_file_stores([compose_cfg("logger=mlflow", f"logger.tracking_uri={tmp_path / 'other'}")])
    check_file_stores([compose_cfg("logger=mlflow")])  # the default SQLite store: not a file store


@pytest.mark.parametrize(
    ("text", "wrong"),
    [('{"wandb": {"id": "ab', "does not read (JSONDecodeError: "), ('["ab12"]', "holds no {kind: ids} mapping")],
)
def test_a_trackers_json_that_does_not_read_is_one_line_not_a_new_tracker_run(tmp_path, text, wrong):
    """A continued run's ``trackers.json`` cut short or not a mapping: one line naming the file and the way out,
    not a new tracker run. No file: no ids (a new run)."""
    assert kept_ids(tmp_path) == {}
    (tmp_path / "trackers.json").write_text(text)
    with pytest.raises(ConfigError) as refused:
        kept_ids(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'trackers.json'} {wrong}")
    assert str(refused.value).endswith(
        ": a continued run reopens the tracker runs it names: restore it, or delete it to open new ones"
    )


def test_a_continued_run_whose_trackers_json_does_not_read_is_refused_before_anything_is_made(
    tmp_path, monkeypatch, capsys
):
    """train.py resume=true into a run directory whose ``trackers.json`` does not read: that one line, exit 2,
    from the start checks (every process of a torchrun job refuses; rank 0 alone left the others waiting 30 s for
    torchrun's SIGKILL): Hydra writes no config, nothing is logged or timed."""
    run_dir = tmp_path / "outputs/run"
    run_dir.mkdir(parents=True)
    (run_dir / "trackers.json").write_text("[1]")
    args = [*ARGS, "logger=mlflow", "hydra.run.dir=outputs/run", "resume=true"]
    assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 2
    out, err = capsys.readouterr()
    line = f"error: {run_dir / 'trackers.json'} holds no {{kind: ids}} mapping: a continued run reopens the tracker"
    assert err.splitlines() == [f"{line} runs it names: restore it, or delete it to open new ones"]
    assert out == "" and sorted(p.name for p in run_dir.iterdir()) == ["trackers.json"]
    (tmp_path / "afile").touch()  # no run directory: its own line, not the trackers.json one
    assert train_py_here(*ARGS, "logger=mlflow", "hydra.run.dir=afile", cwd=tmp_path, monkeypatch=monkeypatch) == 2
    assert capsys.readouterr().err.startswith("error: hydra.run.dir='afile' cannot be written (Not a directory)")


@pytest.mark.parametrize(
    "logger, modules, flags, cls, package",
    [
        (
            "tensorboard",
            ["fabric.loggers.tensorboard"] * 2,
            ["_TENSORBOARD", "_TENSORBOARDX"],
            "TensorBoard",
            "tensorboard>=2.12",
        ),
        ("mlflow", ["pytorch.loggers.mlflow"] * 2, ["_MLFLOW", "_MLFLOW_SYNCHRONOUS"], "MLFlow", "mlflow>=2.8"),
        ("wandb", ["pytorch.loggers.wandb"], ["_WANDB"], "Wandb", "wandb>=0.16"),
    ],
)
def test_a_logger_whose_package_is_missing_is_one_line_with_its_install_before_a_run_directory(
    tmp_path, monkeypatch, capsys, logger, modules, flags, cls, package
):
    """train.py logger=X with X's package missing (Lightning's own requirement flags say so): one line naming the
    setting, the package and its pip install (dpddp's extra), exit 2, no run directory (was: 3 INFO lines, a run
    directory, and for tensorboard the advice to give the class other arguments)."""
    for module, flag in zip(modules, flags, strict=True):
        found = vars(sys.modules[f"lightning.{module}"])[f"{flag}_AVAILABLE"]  # as Lightning finds it missing
        monkeypatch.setattr(found, "available", False, raising=False)
        monkeypatch.setattr(found, "message", f"Requirement {found.requirement!r} not met", raising=False)
    assert train_py_here(*ARGS, f"logger={logger}", cwd=tmp_path, monkeypatch=monkeypatch) == 2
    name = package.partition(">")[0]
    assert capsys.readouterr().err.splitlines() == [
        f"error: logger._target_=lightning.pytorch.loggers.{cls}Logger needs {name}, which is not installed: "
        f"pip install '{package}' (or the extra: pip install -e '.[{name}]')"
    ]
    assert not (tmp_path / "outputs").exists()

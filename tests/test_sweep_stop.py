"""A SIGTERM to a sweep, in one process: a sweep stopped by SIGTERM ends with its summary and one line that resumes it,
for any directory name; a fit leaves the SIGTERM handler it found. (The sweeps themselves: test_sweeps.py.)"""

import json
import shlex
import signal
import sys

import pytest
from conftest import compose_cfg
from hydra.core.override_parser.overrides_parser import OverridesParser

from dpddp.continuity import stop as sweep_stop
from dpddp.entry.hydra import end_sweep
from dpddp.run.training import METRIC_KEYS, train


@pytest.fixture
def sweep_process(monkeypatch):
    """This process as a sweep's own process (``sweep_stop.start``), put back as it was afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(sweep_stop, "_requested", False)
    yield
    signal.signal(signal.SIGTERM, handler)


def _job(sweep, num, files):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- seed={num}\n")
    for name, text in files.items():
        (job / name).parent.mkdir(parents=True, exist_ok=True)
        (job / name).write_text(text)


@pytest.mark.parametrize("name", ["sweep", 'my sweep\'s "dir" 1=2,3'])
def test_a_stopped_sweep_ends_with_its_summary_and_one_line_that_resumes_it(
    tmp_path, monkeypatch, capsys, sweep_process, name
):
    sweep = tmp_path / name
    _job(sweep, 0, {"metrics.json": json.dumps({k: 0.5 for k in METRIC_KEYS})})
    _job(sweep, 1, {"checkpoints/last.ckpt": ""})
    _job(sweep, 2, {})
    _job(sweep, 3, {"error.txt": "model.lr=-1.0 ...\n"})
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "seed=0,1,2,3", "hydra.sweep.dir=old"])
    sweep_stop.start(sweep)
    assert not sweep_stop.requested()
    signal.raise_signal(signal.SIGTERM)  # the sweep's process is told to stop: it only records it
    assert sweep_stop.requested() and (sweep / ".stop").is_file()
    with pytest.raises(SystemExit) as exit:
        end_sweep(sweep)
    assert exit.value.code == 143
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: the sweep was stopped by SIGTERM (1 of 4 jobs finished; stopped with a checkpoint: job 1; "
        "not started: job 2; failed: job 3): resume with python train.py -m seed=0,1,2,3 "
    )
    command = shlex.split(lines[0].split("resume with ", 1)[1])
    assert command[:4] == ["python", "train.py", "-m", "seed=0,1,2,3"] and len(command) == 5
    override = OverridesParser.create().parse_override(command[4])  # the pasted command's: Hydra reads it back
    assert override.key_or_group == "hydra.sweep.dir" and override.value() == str(sweep)
    statuses = [row.split("|")[3].strip() for row in (sweep / "summary.md").read_text().splitlines()[2:]]
    assert statuses[:3] == ["ok", "incomplete: resumes from checkpoints/last.ckpt", "not started"]
    assert not (sweep / ".stop").exists()  # the next invocation starts clean


def test_a_sweep_finished_before_the_stop_ends_as_usual(tmp_path, capsys, sweep_process):
    _job(tmp_path, 0, {"metrics.json": json.dumps({k: 0.5 for k in METRIC_KEYS})})
    sweep_stop.start(tmp_path)
    sweep_stop.request()
    end_sweep(tmp_path)  # no exit: every job finished
    assert "error" not in capsys.readouterr().err


def test_a_fit_puts_back_the_sigterm_handler_it_found(tmp_path):
    """Lightning's teardown puts its handler's predecessor back, then the Preemption callback's teardown used to
    put Lightning's own back: a process that had run a fit (a sweep's worker) then only logged a SIGTERM."""

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        train(compose_cfg("accelerator=cpu", "data.num_samples=400", "trainer.max_epochs=1", "logger=none"), tmp_path)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)

"""Day-to-day use: a line per epoch in batch jobs, one metrics.csv per run across resumes, curves as a
PNG, every invocation's config kept, training time over all segments, and a console without warnings."""

import csv
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import QUIET, ROOT, child_env, compose_cfg, leftover, train_py_here
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from PIL import Image

from dpddp.report.bars import TQDMBar
from dpddp.report.curves import write_plot
from dpddp.report.epochs import EPOCH_COLUMNS
from dpddp.run import assembly
from dpddp.run.training import train

SMALL = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none"]
# A line a warning prints: Python's "file.py:123: SomeWarning: ..." or any line that names a warning.
WARNING_LINE = re.compile(r"\.py:\d+: |warn", re.IGNORECASE)
EPOCH_LINE = r"epoch (\d+)/9: train/loss=\S+ val/loss=\S+ val/acc=\S+ \(\S+ s, [\d,]+ samples/s, peak [\d,]+ MiB\)"


def _table(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        return tuple(reader.fieldnames or ()), list(reader)


TAB10 = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C)]  # matplotlib's C0, C1, C2


def _png_ok(path, runs: int = 1):
    """The PNG draws each of ``runs`` runs' curves, in its own colour (C0, C1, ...: at least 100 pixels of it,
    within antialiasing's blend), and no curve of a run more."""
    image = Image.open(path).convert("RGB")
    assert image.size[0] >= 400 and image.size[1] >= 200
    counts = {colour: n for n, colour in image.getcolors(1 << 24) or []}

    def pixels(rgb) -> int:
        return sum(n for c, n in counts.items() if max(abs(a - b) for a, b in zip(c, rgb, strict=True)) <= 24)

    drawn = [pixels(rgb) for rgb in TAB10]
    assert all(n >= 100 for n in drawn[:runs]) and all(n < 100 for n in drawn[runs:]), drawn


def _train_py(*args, cwd, log):
    """``python train.py ARGS`` with stdout and stderr redirected to the file ``log`` (not a terminal)."""
    env, tag = child_env()
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, stdout=out, stderr=out, timeout=240
        )
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert leftover(tag) == []
    return log.read_text()


def test_resume_from_another_directory_keeps_one_table_and_adds_up_the_time(tmp_path):
    """In process: 2 epochs, then on to 4 from that last.ckpt in a new directory: metrics.csv there holds
    epochs 0..3 once each (the earlier rows travel in the checkpoint), then the test row; 2 segments."""
    first = train(compose_cfg(*SMALL, "trainer.max_epochs=2"), tmp_path / "first")
    ckpt = tmp_path / "first/checkpoints/last.ckpt"
    second = train(compose_cfg(*SMALL, "trainer.max_epochs=4", f"ckpt_path={ckpt}"), tmp_path / "second")
    columns, rows = _table(tmp_path / "second")
    assert columns == EPOCH_COLUMNS
    assert [(r["stage"], int(r["epoch"])) for r in rows] == [*(("fit", e) for e in range(4)), ("test", 3)]
    assert all(r["train/loss"] and r["val/loss"] and r["val/acc"] for r in rows[:4])
    assert float(rows[4]["test/acc"]) == pytest.approx(second["test/acc"])
    assert _table(tmp_path / "first")[1][:2] == rows[:2]
    assert first["segments"] == 1 and second["segments"] == 2
    assert second["train_time_s"] > first["train_time_s"] > 0
    assert json.loads((tmp_path / "second/metrics.json").read_text())["segments"] == 2


def test_a_finished_run_continued_keeps_its_figures_and_logs_no_checkpoint_line(tmp_path, caplog):
    """In process: a finished run continued with the same limits trains nothing; its metrics.json keeps the run's
    throughput, training time, segment count and final train/loss (from the checkpoint), not nulls; rewriting
    last.ckpt logs no Lightning line about ``weights_only``."""
    first = train(compose_cfg(*SMALL, "trainer.max_epochs=2"), tmp_path)
    ckpt = tmp_path / "checkpoints/last.ckpt"
    with caplog.at_level("INFO"):
        again = train(compose_cfg(*SMALL, "trainer.max_epochs=2", f"ckpt_path={ckpt}"), tmp_path / "again")
    assert again["samples_per_sec"] == first["samples_per_sec"] > 0  # the same counts, restored
    assert 0 < again["train_time_s"] <= first["train_time_s"]  # the checkpoint's: taken at the last epoch's end
    assert again["segments"] == 1 and again["first_step_unix_s"] is None
    assert again["train/loss"] == pytest.approx(first["train/loss"], abs=1e-7)  # the last epoch's row
    assert "missing" not in json.loads((tmp_path / "again/metrics.json").read_text())
    assert again["val/loss"] == pytest.approx(first["val/loss"], abs=1e-7)
    assert (tmp_path / "again/checkpoints/last.ckpt").is_file()
    assert _table(tmp_path / "again") == _table(tmp_path)  # the checkpoint's rows, then the same test row
    assert not [r.getMessage() for r in caplog.records if "weights_only" in r.getMessage()]


def test_plot_of_a_run_and_of_a_sweep(tmp_path):
    for seed in (0, 1):
        train(
            compose_cfg(*SMALL, "trainer.max_epochs=2", f"seed={seed}", "curves=true"), tmp_path / "sweep" / str(seed)
        )
    _png_ok(tmp_path / "sweep/0/curves.png")  # written at the end of the run (matplotlib is in the dev extra)
    out = write_plot(tmp_path / "sweep")
    assert out == tmp_path / "sweep/curves.png"
    _png_ok(out, runs=2)


@pytest.mark.parametrize(("kind", "k"), [("rich", 1), ("tqdm", 1), ("rich", 16), ("tqdm", 16)])
def test_the_bar_counts_optimizer_steps_under_any_steps_per_execution(tmp_path, monkeypatch, kind, k):
    """Lightning's own bar, shown at every loop's last batch; with ``steps_per_execution=16`` it counts global
    batches, as with 1: 800 of 800 (every 16th), not 50 executions."""
    base = RichProgressBar if kind == "rich" else TQDMProgressBar
    if kind == "tqdm":  # the tqdm bar is the one without rich installed
        monkeypatch.setattr(assembly, "RichBar", lambda **_: TQDMBar())
    shown: dict[str, list[int]] = {}
    at_epoch_end = []

    def spy(hook, update):
        def shows(self, trainer, pl_module, outputs, batch, batch_idx, *rest):
            shown.setdefault(hook, []).append(batch_idx + 1)
            return update(self, trainer, pl_module, outputs, batch, batch_idx, *rest)

        return shows

    def train_bar(self):
        if isinstance(self, TQDMProgressBar):
            return self.train_progress_bar.n, self.train_progress_bar.total
        (task,) = [t for t in self.progress.tasks if t.id == self.train_progress_bar_id]
        return task.completed, task.total

    def epoch_end(self, trainer, pl_module):
        base_epoch_end(self, trainer, pl_module)
        at_epoch_end.append((*train_bar(self), self.refresh_rate))

    for hook in ("on_train_batch_end", "on_validation_batch_end", "on_test_batch_end"):
        monkeypatch.setattr(base, hook, spy(hook, getattr(base, hook)))
    base_epoch_end = base.on_train_epoch_end
    monkeypatch.setattr(base, "on_train_epoch_end", epoch_end)
    sizes = ["data.num_samples=8000", "data.batch_size=8", "trainer.max_epochs=1"]  # 800, 100 and 100 batches
    train(
        compose_cfg(
            "accelerator=cpu", "logger=none", *sizes, "trainer.enable_progress_bar=true", f"steps_per_execution={k}"
        ),
        tmp_path,
    )
    assert {hook: seen[-1] for hook, seen in shown.items()} == {
        "on_train_batch_end": 800, "on_validation_batch_end": 100, "on_test_batch_end": 100
    }  # fmt: skip
    assert shown["on_train_batch_end"] == list(range(k, 801, k))
    assert at_epoch_end == [(800, 800, 10 if kind == "rich" else 1)]  # rich: redraws a second; tqdm: batches


@pytest.mark.slow
def test_the_quickstart_run_redirected_learns_prints_epoch_lines_and_no_warning(tmp_path):
    """The README's quick start, ``python train.py`` (10 epochs, one process), with its output in a file: it
    learns, writes its run directory under outputs/<date>/<time>/, one line per epoch in the file and in
    train.log, the final metrics line readable, and no warning line at all."""
    output = _train_py(cwd=tmp_path, log=tmp_path / "out.txt")
    (run,) = [p.parent for p in tmp_path.glob("outputs/*/*/metrics.json")]
    m = json.loads((run / "metrics.json").read_text())
    assert m["val/acc"] >= 0.9 and m["world_size"] == 1 and (run / ".hydra/config.yaml").is_file()
    train_log = (run / "train.log").read_text()
    for text in (output, train_log):
        assert re.findall(EPOCH_LINE, text) == [str(e) for e in range(10)]  # from 0, as metrics.csv
    assert [line for line in output.splitlines() if WARNING_LINE.search(line)] == []
    assert "Tip:" not in output and "v_num" not in output
    (metrics_line,) = [line for line in output.splitlines() if "metrics: " in line]
    assert "e+0" not in metrics_line and "first_step_unix_s" not in metrics_line


@pytest.mark.parametrize("given", ["run", "sub/../run"])
def test_a_continue_logs_what_it_continues_however_the_run_directory_is_spelled(tmp_path, monkeypatch, given):
    """A finished run continued to a later limit logs ``continuing finished job from <its last.ckpt>`` also where
    ``hydra.run.dir`` goes through ``..`` (Hydra's output directory is normalised; the decision's path was not, and
    the line went missing)."""
    args = ["accelerator=cpu", "data.num_samples=200", "logger=none", "epoch_lines=false"]
    assert train_py_here(*args, "trainer.max_steps=1", "hydra.run.dir=run", cwd=tmp_path, monkeypatch=monkeypatch) == 0
    (tmp_path / "sub").mkdir()
    again = ["trainer.max_steps=2", "resume=true", f"hydra.run.dir={given}"]
    assert train_py_here(*args, *again, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    log = (tmp_path / "run/train.log").read_text()
    assert f"continuing finished job from {tmp_path / 'run/checkpoints/last.ckpt'} to " in log


@pytest.mark.slow
def test_continued_run_keeps_both_configs_one_table_and_the_time(tmp_path, monkeypatch, capfd):
    """2 epochs (resume=true into a directory with no checkpoint yet: a fresh run; train.py here), then the same
    run directory continued to 4 (resume=true; a process, its console read): both invocations' configs kept, the
    log says "continuing", the step is 4 epochs', metrics.csv is one table (epochs 0..3 once each), time and
    segments add up, and python -m dpddp.plot draws the continued run."""
    args = ["accelerator=cpu", "data.num_samples=1005", "hydra.run.dir=run", "resume=true"]
    defaults = ["trainer.enable_progress_bar=null", "curves=true"]  # train.py's, where train_py_here sets QUIET
    assert train_py_here(*args, "trainer.max_epochs=2", *defaults, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    assert "resume=true but there is no" in "".join(capfd.readouterr())
    first = json.loads((tmp_path / "run/metrics.json").read_text())
    output = _train_py(*args, "trainer.max_epochs=4", cwd=tmp_path, log=tmp_path / "second.txt")
    run = tmp_path / "run"
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4 * (805 // 64)
    assert "trainer.max_epochs=2" in (run / ".hydra/overrides.yaml").read_text()
    assert "trainer.max_epochs=4" in (run / ".hydra-1/overrides.yaml").read_text()
    assert "max_epochs: 2" in (run / ".hydra/config.yaml").read_text()
    assert "max_epochs: 4" in (run / ".hydra-1/config.yaml").read_text()
    log = (run / "train.log").read_text()
    assert "invocation 2 into this run directory: config and overrides in .hydra-1/" in log
    assert "continuing finished job from" in log and "resuming" not in log
    assert [line for line in output.splitlines() if WARNING_LINE.search(line)] == []
    columns, rows = _table(run)
    assert columns == EPOCH_COLUMNS
    assert [int(r["epoch"]) for r in rows if r["stage"] == "fit"] == [0, 1, 2, 3]
    assert [r["stage"] for r in rows] == ["fit"] * 4 + ["test"]
    second = json.loads((run / "metrics.json").read_text())
    assert first["segments"] == 1 and second["segments"] == 2
    assert second["train_time_s"] > first["train_time_s"]
    (run / "curves.png").unlink()
    env, _ = child_env()
    proc = subprocess.run([sys.executable, "-m", "dpddp.plot", str(run)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    _png_ok(run / "curves.png")


def _fake_job(sweep, num, overrides, losses):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra/overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    rows = [",".join(["stage", *EPOCH_COLUMNS[1:]])]
    rows += [f"fit,{e},{10 * (e + 1)},{loss},{loss},0.5,,,0.1,1000" for e, loss in enumerate(losses)]
    (job / "metrics.csv").write_text("\n".join(rows) + "\n")
    (job / "metrics.json").write_text(json.dumps({"val/loss": losses[-1], "overrides": overrides}))


def test_a_sweeps_summary_and_plot_name_only_what_differs_between_jobs(tmp_path, capsys):
    """Found by the fresh-user trial: every row and legend entry repeated the overrides common to all jobs, and
    the legend ran off the PNG. Now the common ones are one line above the table, the legend names each job by
    what differs, and the PNG grows under the plots to hold it."""
    from dpddp.entry.hydra import write_summary
    from dpddp.report.curves import curves

    common = ["accelerator=cpu", "trainer.max_epochs=3", "+callbacks.early_stopping.monitor=val/loss"]
    varied = [["model.lr=0.1", "data.batch_size=32"], ["model.lr=0.01", "data.batch_size=32"], ["model.lr=0.1"]]
    for num, extra in enumerate(varied):
        _fake_job(tmp_path, num, [*common[:1], *extra, *common[1:]], [1.0 / (num + 1), 0.5 / (num + 1), 0.2])
    write_summary(tmp_path)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[0] == f"overrides of every job: {' '.join(common)}"
    assert [row.split(" | ")[:2] for row in lines[4:]] == [
        ["| 0", "model.lr=0.1 data.batch_size=32"],
        ["| 1", "model.lr=0.01 data.batch_size=32"],
        ["| 2", "model.lr=0.1"],
    ]
    assert lines[0] in capsys.readouterr().out
    assert list(curves(tmp_path)) == [
        "0 model.lr=0.1 data.batch_size=32",
        "1 model.lr=0.01 data.batch_size=32",
        "2 model.lr=0.1",
    ]
    one = write_plot(tmp_path / "0", tmp_path / "one.png")  # one run: no legend, the figure's own size
    assert Image.open(tmp_path / "curves.png").size[1] > Image.open(one).size[1]  # the legend's rows below
    _png_ok(tmp_path / "curves.png", runs=3)
    _png_ok(one)


def test_a_sweeps_summary_names_its_best_job_by_the_objective_and_its_direction(tmp_path, capsys):
    from omegaconf import OmegaConf

    from dpddp.entry.hydra import objective_of, write_summary

    for num, loss in enumerate([0.5, 0.2, float("nan"), 0.3]):
        _fake_job(tmp_path, num, [f"seed={num}"], [1.0, loss])
    (tmp_path / "2/error.txt").write_text("error: diverged\n")  # a failed job is never the best
    rows = write_summary(tmp_path, ("val/loss", False))
    assert [row["best"] for row in rows] == [False, True, False, False]
    table = (tmp_path / "summary.md").read_text().splitlines()
    assert table[0].endswith(" | best |") and [line.endswith(" | best |") for line in table[2:]] == [0, 1, 0, 0]
    assert "best: job 1 (val/loss=0.2, the lowest)" in capsys.readouterr().out.splitlines()
    with open(tmp_path / "summary.csv", newline="") as f:
        assert [r["best"] for r in csv.DictReader(f)] == ["False", "True", "False", "False"]
    write_summary(tmp_path, ("val/loss", True))
    assert "best: job 0 (val/loss=0.5, the highest)" in capsys.readouterr().out.splitlines()
    optuna = OmegaConf.create({"objective": "val/acc", "hydra": {"sweeper": {"direction": "maximize"}}})
    by_mode = OmegaConf.create({"objective": "val/acc", "callbacks": {"model_checkpoint": {"mode": "max"}}})
    assert objective_of(optuna) == objective_of(by_mode) == ("val/acc", True)
    assert objective_of(OmegaConf.create({"objective": None})) == ("val/loss", False)

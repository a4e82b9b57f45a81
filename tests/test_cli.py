"""LightningCLI entry point: print_config round trip, ddp and dp fits, re-runs, predictions."""

import csv
import functools
import json
import logging
import shlex
from pathlib import Path

import pytest
import torch
from conftest import QUIET, cli_config, cli_here, compose_cfg, max_diff, run_cli, weights

from dpddp.data.synthetic import make_tensors
from dpddp.entry.lightning_cli import main
from dpddp.run.training import METRIC_KEYS, train

pytestmark = pytest.mark.slow
FAST = ["--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false"]


cli = functools.partial(run_cli, check=True)
"""``python -m dpddp.cli ARGS`` (or ``script=True``: the console script): exit 0 and no leftover process."""


@pytest.fixture
def cli_here_ok(monkeypatch, capsys):
    """``cli_here_ok(*args, cwd=...)``: a one-process ``python -m dpddp.cli ARGS`` run in this process (its ranks
    are not the point): asserts exit 0, returns what it wrote to stdout and stderr."""

    def run(*args: str, cwd: Path) -> str:
        capsys.readouterr()
        code = cli_here(*args, cwd=cwd, monkeypatch=monkeypatch)
        out, err = capsys.readouterr()
        assert code == 0, f"{' '.join(args)}\n{err[-3000:]}"
        return out + err

    return run


def _ckpt(root):
    (path,) = root.glob("lightning_logs/version_*/checkpoints/last.ckpt")
    return path


def test_print_config_round_trip(tmp_path, cli_status, cli_here_ok):
    code, printed = cli_status("fit", *FAST, "--model.lr=0.05", "--data.batch_size=32", "--print_config")
    assert code == 0
    assert "strategy: auto" in printed and "batch_size: 32" in printed and "lr: 0.05" in printed
    (tmp_path / "config.yaml").write_text(printed)
    cli_here_ok("fit", *FAST, "--model.lr=0.05", "--data.batch_size=32", "--trainer.default_root_dir=a", cwd=tmp_path)
    cli_here_ok("fit", "--config", "config.yaml", "--trainer.default_root_dir=b", cwd=tmp_path)
    assert max_diff(weights(_ckpt(tmp_path / "a")), weights(_ckpt(tmp_path / "b"))) == 0


def test_fit_ddp_and_dp_and_rerun_into_the_same_directory(tmp_path, cli_here_ok):
    """LightningCLI refusing to re-run into an existing directory: the same command twice into the same
    default_root_dir runs again and keeps the first run's files. The console script starts the ddp run."""
    root = ["--trainer.default_root_dir=runs"]
    cli("fit", *FAST, "--trainer.strategy=ddp", "--trainer.devices=2", *root, cwd=tmp_path, script=True)
    cli_here_ok("fit", *FAST, "--trainer.strategy=dp", "--trainer.devices=1", *root, cwd=tmp_path)
    cli_here_ok("fit", *FAST, "--trainer.strategy=dp", "--trainer.devices=1", *root, cwd=tmp_path)
    configs = sorted(p.relative_to(tmp_path / "runs").as_posix() for p in tmp_path.glob("runs/**/config*.yaml"))
    assert len(configs) == 3 and len({c.split("/")[1] for c in configs}) == 3
    ckpts = sorted(tmp_path.glob("runs/lightning_logs/version_*/checkpoints/last.ckpt"))
    # the global batch makes 1 ddp process pair and 1 dp process take the same steps to the same weights
    assert max_diff(weights(ckpts[0]), weights(ckpts[1])) <= 1e-5


def test_predict_under_ddp_writes_every_test_sample_once_in_order(tmp_path):
    fit = ["accelerator=cpu", "trainer.max_epochs=1", "data.num_samples=1005", "logger=none", *QUIET]
    train(compose_cfg(*fit), tmp_path / "fit")  # what the CLI's fit runs, in process
    ckpt = tmp_path / "fit/checkpoints/last.ckpt"
    args = ["--trainer.strategy=ddp", "--trainer.devices=2", "--data.num_samples=1005", "--data.batch_size=32"]
    out = cli("predict", *FAST, *args, f"--ckpt_path={ckpt}", "--trainer.default_root_dir=pred", cwd=tmp_path)
    (path,) = tmp_path.glob("pred/**/predictions.csv")
    said = out.stdout + out.stderr
    assert f"predictions: {path} (100 rows)" in said  # where they went
    (line,) = [line for line in said.splitlines() if "metrics: " in line]
    assert "nan" not in line and "world_size=2" in line  # no metric a predict run does not make
    missing = json.loads((path.parent / "metrics.json").read_text())["missing"]
    for key in (*METRIC_KEYS, "samples_per_sec", "train_time_s"):  # (first_step_unix_s: null)
        assert missing[key] == "a predict run: only predict ran", key
    rows = list(csv.DictReader(open(path)))
    assert [int(r["index"]) for r in rows] == list(range(905, 1005))  # the test split's rows: 1005 * 0.1 samples
    y = make_tensors(0, 1005, 16, 4)[1][905:]
    assert [int(r["target"]) for r in rows] == y.tolist()
    probs = torch.tensor([[float(r[f"prob_{c}"]) for c in range(4)] for r in rows])
    assert torch.allclose(probs.sum(1), torch.ones(100), atol=1e-5)
    assert [int(r["pred"]) for r in rows] == probs.argmax(1).tolist()


@pytest.fixture
def cli_status(tmp_path, monkeypatch, capsys):
    """``cli_status(*args)``: what ``python -m dpddp.cli ARGS`` runs (``main``), in this process and in
    ``tmp_path``, for a refusal or ``--print_config``: its exit status and stderr (stdout with ``--print_config``).
    The root logger's handlers are put back after (the CLI logs into its run directory's train.log)."""
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def status(*args: str) -> tuple[int | str | None, str]:
        try:
            with pytest.raises(SystemExit) as stop:
                main(list(args))
        finally:
            for handler in root.handlers:
                if handler not in handlers:
                    handler.close()
            root.handlers[:], root.level = handlers, level
        out, err = capsys.readouterr()
        return stop.value.code, out if "--print_config" in args else err

    return status


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["--data.val_fraction=0.95", "--data.num_samples=1024"],
            "error: data.val_fraction=0.95 is invalid: use a fraction in [0, 0.9]",
        ),
        (["--data.seed=-1"], "error: data.seed=-1 is invalid: use an integer in [0, 2**32 - 1]"),
        (
            ["--trainer.strategy=ddp", "--trainer.devices=2", "--data.batch_size=63"],
            "error: data.batch_size=63 (global) does not divide by the world size 2 (devices x num_nodes): use a "
            "multiple of 2",
        ),
        (
            ["--steps_per_execution=4", "--trainer.accumulate_grad_batches=2"],
            "error: trainer.accumulate_grad_batches=2 cannot be kept with steps_per_execution=4 (an execution takes "
            "one optimizer step per global batch): remove it, or use steps_per_execution=1",
        ),
        (
            ["--compile=true", "--trainer.strategy=dp"],
            "error: strategy='dp' cannot be kept with compile=true (DataParallel's replicas run the model's forward "
            "uncompiled; ddp compiles it on every rank): remove it, or use compile=false",
        ),
    ],
)
def test_the_cli_applies_the_checks_of_train_py(tmp_path, cli_status, args, line):
    """An entry point that would skip the checks of the others: the same check, one line (once, not per rank),
    exit 2, nothing written."""
    code, err = cli_status("fit", *FAST, *args)
    assert code == 2
    assert err.splitlines() == [line]  # no "Seed set" or invocation line before it
    assert list(tmp_path.iterdir()) == []  # no run directory made


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["fit", "--trainer.devises=2"],
            "--trainer.devises=2: no such option (nearest: --trainer.devices): see dpddp fit --help",
        ),
        (
            ["fit", "--trainer.devises", "2"],
            "--trainer.devises 2: no such option (nearest: --trainer.devices): see dpddp fit --help",
        ),
        (
            ["fit", "--modle.lr=0.1"],  # the class option's name misspelled: its class's keys are not parsed yet
            "--modle.lr=0.1: no such option (nearest: --model.lr): see dpddp fit --help",
        ),
        (
            ["fit", "--zzz=1"],
            "--zzz=1: no such option: see dpddp fit --help",
        ),
        (
            ["fit", "--data.num_workers=2"],  # an option of other data modules
            "--data.num_workers=2: dpddp.data.random_tensors.RandomTensorDataModule takes no num_workers (its "
            "options: num_samples, num_features, num_classes, batch_size, val_fraction, test_fraction, label_noise, "
            "seed, streaming, micro_batch_size): give one of its options, or another --data=pkg.Class",
        ),
        (
            ["test", "--model.lrr=0.1"],
            "--model.lrr=0.1: dpddp.models.linear.LinearClassifier takes no lrr (did you mean --model.lr?): give one "
            "of its options, or another --model=pkg.Class",
        ),
        (
            ["fit", "--trainer.max_epochs=abc"],
            "--trainer.max_epochs=abc is invalid: pl.Trainer takes int or null for max_epochs: see dpddp fit --help",
        ),
        (
            ["fit", "--trainer.deterministic=maybe"],
            "--trainer.deterministic=maybe is invalid: pl.Trainer takes bool, 'warn' or null for deterministic: see "
            "dpddp fit --help",
        ),
        (
            ["fit", "--model.lr=abc"],
            "--model.lr=abc is invalid (expected float): give a value of that type, see dpddp fit --help",
        ),
        (
            ["fit", "--steps_per_execution=fast"],
            "--steps_per_execution=fast is invalid (expected int or 'auto'): give a value of that type, see dpddp "
            "fit --help",
        ),
        (
            ["fit", "--monitor_mode=maximum"],
            "--monitor_mode=maximum is invalid (expected 'min', 'max'): give a value of that type, see dpddp fit "
            "--help",
        ),
        (
            ["fit", "--model=nope.Nope"],
            "--model=nope.Nope: nope.Nope cannot be used (No module named 'nope'): give an importable class, e.g. "
            "--model=pkg.Class",
        ),
        (
            ["fit", "--trainer.strategy=ddpp"],  # a strategy with no packaged config: no traceback from composing
            "--trainer.strategy=ddpp is unknown (did you mean ddp?): choose one of auto, ddp, ddp_spawn, dp",
        ),
        (["fit", "--trainer.max_epochs"], "argument --trainer.max_epochs: expected one argument: see dpddp fit --help"),
        (
            ["fti", "--trainer.max_epochs=1"],
            "'fti' is not a subcommand (did you mean fit?): dpddp {fit,validate,test,predict} [--help] [--config FILE] "
            "[--print_config] [ARGS]",
        ),
    ],
)
def test_an_option_the_cli_does_not_take_is_one_line_naming_it_and_the_nearest(tmp_path, cli_status, args, line):
    """jsonargparse's refusal (a usage of about 50 lines) and an unknown subcommand: one line, exit 2, nothing
    written; ``--help`` still prints the usage and exits 0."""
    code, err = cli_status(*args)
    assert (code, err.splitlines()) == (2, [f"error: {line}"])
    assert list(tmp_path.iterdir()) == []
    assert cli_status("fit", "--help")[0] == 0


def test_a_misspelled_key_of_a_config_file_is_one_line_with_the_nearest(tmp_path, cli_status):
    (tmp_path / "run.yaml").write_text("trainer:\n  devises: 2\n  max_epochs: 1\n")
    code, err = cli_status("fit", "--config", str(tmp_path / "run.yaml"))
    line = "trainer.devises (in a --config file): no such option (nearest: trainer.devices): see dpddp fit --help"
    assert (code, err.splitlines()) == (2, [f"error: {line}"])


def test_the_cli_prints_the_trainer_defaults_that_run_and_keeps_a_value_equal_to_lightnings_default(cli_status):
    """``--print_config`` shows the packaged trainer defaults (``sync_batchnorm: true``: BatchNorm over the global
    batch, the run's ``null``; ``enable_model_summary: false``), and a value given equal to Lightning's own default
    reaches the run: ``--trainer.sync_batchnorm=false`` keeps each process's statistics (it was taken for the
    default, and synced), ``--trainer.enable_model_summary=true`` prints the summary."""
    from dpddp.entry.lightning_cli import DPDDPCLI, run_config, trainer_defaults, with_default_classes

    code, printed = cli_status("fit", "--print_config")
    assert code == 0 and "  sync_batchnorm: true\n" in printed and "  enable_model_summary: false\n" in printed
    assert "  max_epochs: 10\n" in printed and "  use_distributed_sampler: false\n" in printed

    def run_trainer(*args):
        cli = DPDDPCLI(
            None, None, args=with_default_classes(list(args)), trainer_defaults=trainer_defaults(),
            seed_everything_default=0, save_config_callback=None, auto_configure_optimizers=False, run=False,
        )  # fmt: skip
        return run_config(cli.config, cli.parser.get_defaults()).trainer

    default = run_trainer("--trainer.strategy=ddp")
    assert default.sync_batchnorm is None and default.enable_model_summary is False  # train.py's: global BatchNorm
    given = run_trainer("--trainer.sync_batchnorm=false", "--trainer.enable_model_summary=true")
    assert given.sync_batchnorm is False and given.enable_model_summary is True


def test_ckpt_path_last_continues_the_newest_run_in_its_directory(tmp_path, cli_status, cli_here_ok):
    """The CLI keeps the layout of the others: ``--ckpt_path=last`` resumes the latest run where a user expects it,
    keeping both invocations' configs, one metrics table and both segments; without a run, one line."""
    root = ["--trainer.default_root_dir=runs", "--data.num_samples=1005"]
    code, err = cli_status("fit", *FAST, *root, "--ckpt_path=last")
    assert code == 2 and "--ckpt_path=last: no run under" in err
    outputs = [cli_here_ok("fit", *FAST, *root, "--trainer.max_epochs=2", cwd=tmp_path)]
    outputs.append(cli_here_ok("fit", *FAST, *root, "--trainer.max_epochs=4", "--ckpt_path=last", cwd=tmp_path))
    assert all("metrics: train/loss=" in out for out in outputs)
    assert sorted(p.name for p in (tmp_path / "runs/lightning_logs").iterdir()) == ["version_0"]
    run = tmp_path / "runs/lightning_logs/version_0"
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4 * (805 // 64)
    assert "max_epochs: 2" in (run / "config.yaml").read_text()  # the first config is kept
    assert "max_epochs: 4" in (run / "config-1.yaml").read_text()
    with open(run / "metrics.csv", newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f) if r["stage"] == "fit"] == [0, 1, 2, 3]
    assert json.loads((run / "metrics.json").read_text())["segments"] == 2


def test_the_resume_line_continues_the_run_in_its_directory(tmp_path):
    """The ``resume with`` command of a stopped CLI run: the same arguments, the run's root and its last.ckpt."""
    from dpddp.entry.lightning_cli import _resume_command

    run = tmp_path / "my runs" / "lightning_logs" / "version_3"
    given = ["--trainer.max_epochs=4", "--ckpt_path=old.ckpt", "--trainer.default_root_dir=old"]
    assert shlex.split(_resume_command("fit", given, run)) == [
        "dpddp",
        "fit",
        "--trainer.max_epochs=4",
        f"--trainer.default_root_dir={tmp_path / 'my runs'}",
        "--ckpt_path=last",
    ]


def test_each_invocation_into_a_run_directory_keeps_its_own_config(tmp_path):
    from dpddp.errors import invocation_name, invocations

    assert [invocation_name("config.yaml", n) for n in (1, 2, 3)] == ["config.yaml", "config-1.yaml", "config-2.yaml"]
    assert [invocation_name(".hydra", n) for n in (1, 2)] == [".hydra", ".hydra-1"]
    assert invocations(tmp_path, "config.yaml") == []
    for name in ("config.yaml", "config-1.yaml"):
        (tmp_path / name).write_text("")
    assert [p.name for p in invocations(tmp_path, "config.yaml")] == ["config.yaml", "config-1.yaml"]


def test_monitor_and_its_mode_choose_best_ckpt_and_the_objective_and_null_drops_best_ckpt(
    tmp_path, cli_status, cli_here_ok
):
    """``--monitor=val/acc --monitor_mode=max`` is the best checkpoint's monitor and mode and the run's objective,
    as ``callbacks.model_checkpoint.monitor`` is for ``train.py``; ``--monitor=null`` drops best.ckpt's callback
    and the objective stays ``val/loss``, as ``train.py callbacks.model_checkpoint=null``'s."""
    code, printed = cli_status(
        "fit", *FAST, "--monitor=val/acc", "--monitor_mode=max", "--compile=lite", "--print_config"
    )
    assert code == 0 and "monitor: val/acc" in printed and "monitor_mode: max" in printed and "compile: lite" in printed
    cfg = cli_config("--monitor=val/acc", "--monitor_mode=max")
    assert (cfg.callbacks.model_checkpoint.monitor, cfg.callbacks.model_checkpoint.mode, cfg.objective) == (
        "val/acc",
        "max",
        "val/acc",
    )
    dropped = cli_config("--monitor=null")
    assert dropped.callbacks.model_checkpoint is None and dropped.callbacks.last_checkpoint is not None
    assert dropped.objective == compose_cfg("callbacks.model_checkpoint=null").objective == "val/loss"
    cli_here_ok("fit", *FAST, "--monitor=val/acc", "--monitor_mode=max", cwd=tmp_path)
    (run,) = tmp_path.glob("lightning_logs/version_*")
    best = torch.load(run / "checkpoints/best.ckpt", weights_only=False)
    (key,) = [k for k, v in best["callbacks"].items() if k.startswith("ModelCheckpoint") and v["monitor"]]
    assert "'monitor': 'val/acc', 'mode': 'max'" in key
    assert best["callbacks"][key]["best_model_score"].item() == pytest.approx(max_val_acc(run / "metrics.csv"))
    assert json.loads((run / "metrics.json").read_text())["objective"] == "val/acc"


def max_val_acc(metrics_csv):
    rows = list(csv.DictReader(metrics_csv.open()))
    return max(float(r["val/acc"]) for r in rows if r.get("val/acc"))


def test_the_cli_without_checkpointing_drops_the_checkpoint_callbacks_and_writes_none(tmp_path, cli_here_ok):
    """``--trainer.enable_checkpointing=false`` means no checkpoint callback, as in Lightning: dpddp's two are
    dropped (``train.py`` says which to drop, with its keys; the CLI has no option for them)."""
    cli_here_ok("fit", *FAST, "--trainer.enable_checkpointing=false", cwd=tmp_path)
    (run,) = tmp_path.glob("lightning_logs/version_*")
    assert list(tmp_path.rglob("*.ckpt")) == [] and json.loads((run / "metrics.json").read_text())["test/acc"] > 0


@pytest.fixture(scope="module")
def unusable(tmp_path_factory) -> Path:
    """A one-epoch run's checkpoints: last.ckpt, wo.ckpt (weights only) and cut.ckpt (its first half)."""
    run = tmp_path_factory.mktemp("first")
    wo = ["+callbacks.wo._target_=lightning.pytorch.callbacks.ModelCheckpoint", "+callbacks.wo.filename=wo"]
    args = [*QUIET, "accelerator=cpu", "data.num_samples=200", "trainer.max_epochs=1", "logger=none"]
    train(compose_cfg(*args, *wo, "+callbacks.wo.save_weights_only=true"), run)
    whole = (run / "checkpoints" / "last.ckpt").read_bytes()
    (run / "checkpoints" / "cut.ckpt").write_bytes(whole[: len(whole) // 2])
    return run / "checkpoints"


@pytest.mark.parametrize(
    "name,extra,said",
    [
        ("wo.ckpt", [], "holds the model's weights only"),
        ("cut.ckpt", [], "cannot be read as a checkpoint"),
        ("last.ckpt", ["--model=dpddp.models.mlp.MLPClassifier"], "holds another model's weights"),
    ],
)
def test_a_checkpoint_the_cli_cannot_continue_from_is_one_line(tmp_path, cli_status, unusable, name, extra, said):
    """The checkpoint kinds ``train.py`` refuses (weights only, truncated, another model's): the same line through
    the CLI's ``--ckpt_path``, exit 2, nothing written."""
    code, err = cli_status("fit", *FAST, f"--ckpt_path={unusable / name}", *extra)
    (line,) = err.splitlines()
    assert code == 2 and line.startswith(f"error: ckpt_path='{unusable / name}' ") and said in line, err
    assert list(tmp_path.iterdir()) == []

"""Faults users of Lightning + Hydra projects meet, one test per kind, each with its right value: presets the
primary config overrides, linked settings that disagree, stray launcher variables, a cluster world under a
one-process strategy, generated commands Hydra cannot parse, a resume that would start fresh, a run written into
another run's directory, a memory check whose advice does not fit, an unknown config option."""

import shlex
import subprocess
import sys

import pytest
import torch
from conftest import CONF, ROOT, child_env, compose_cfg, train_py_here
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import given, settings
from hypothesis import strategies as st

from dpddp.cluster import RANK_VARIABLES
from dpddp.entry.hydra import _resume_command, hydra_value
from dpddp.errors import ConfigError
from dpddp.run.config import check_config

PRESET = """# @package _global_
seed: 7
devices: 2
strategy:
  name: ddp
data:
  batch_size: 128
"""


def test_a_preset_sets_top_level_keys_and_the_command_line_still_wins(tmp_path):
    """A preset's top-level keys (``seed``, ``devices``) are not overridden by the primary config's own values
    (``_self_`` comes first in config.yaml's defaults), and the command line still wins over the preset."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(PRESET)
    search = f"hydra.searchpath=[file://{tmp_path}]"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[search, "experiment=mine"])
        assert (cfg.seed, cfg.devices, cfg.strategy.name, cfg.data.batch_size, cfg.data.seed) == (7, 2, "ddp", 128, 7)
        cfg = compose(config_name="config", overrides=[search, "experiment=mine", "seed=3", "devices=1"])
        assert (cfg.seed, cfg.devices, cfg.data.seed) == (3, 1, 3)


@pytest.mark.parametrize("key,value", [("num_classes", 3), ("num_features", 5)])
def test_linked_model_and_data_settings_that_disagree_are_one_line(key, value):
    """A model size that disagrees with the data's is one line naming both settings and their values, not
    Lightning's hparams-merging traceback; for every linked pair."""
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(f"model.{key}={value}"))
    default = compose_cfg()["data"][key]
    assert str(err.value) == (
        f"model.{key}={value} differs from data.{key}={default}: set data.{key} only (model.{key} follows it)"
    )


@pytest.mark.parametrize(
    "env,named",
    [
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0"),
        ({"RANK": "1"}, "RANK=1"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "RANK=0, WORLD_SIZE=2"),
        ({"NODE_RANK": "1"}, "NODE_RANK=1"),  # a node rank, but num_nodes=1
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK=x"),  # refused before the world reads it as a number
    ],
)
def test_stray_rank_variables_are_refused_naming_them(monkeypatch, env, named):
    """Rank variables left by a shell, a container or an earlier job, with no launcher that set them: one line
    naming them and how to clear them, before anything waits on a rank that will never start."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=f"^{named} set in the environment, but no launcher") as err:
        check_config(compose_cfg("strategy=ddp", "devices=2", "accelerator=cpu"))
    assert f"unset {' '.join(k for k in RANK_VARIABLES if k in env)} (e.g. env -u" in str(err.value)


def test_rank_variables_of_a_real_launcher_are_trusted(monkeypatch):
    for key, value in {"NODE_RANK": "1", "MASTER_ADDR": "198.18.255.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(key, value)  # Lightning's multi-node launch by hand, on node 1
    by_hand = compose_cfg("strategy=ddp", "devices=2", "num_nodes=2", "accelerator=cpu")
    assert check_config(by_hand).world.world_size == 4  # a ConfigError if the variables were taken for stray ones
    for key, value in {"TORCHELASTIC_RUN_ID": "r", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    torchrun = compose_cfg("strategy=ddp", "devices=1", "num_nodes=2", "accelerator=cpu")
    assert check_config(torchrun).world.world_size == 2


NODES = "num_nodes=2 without a launcher, but"
FAR = "198.18.255.1"  # an address no interface here holds
ONE_MACHINE = (
    "but a one-machine run (num_nodes=1) starts every rank here: unset MASTER_ADDR (env -u MASTER_ADDR python "
    "train.py ...), or run under a launcher (torchrun, SLURM) to use several machines"
)
BY_HAND = (
    "set MASTER_ADDR (node 0's address) and MASTER_PORT alike on every node and NODE_RANK on each, or start the "
    "nodes with torchrun"
)


@pytest.mark.parametrize(
    "env,nodes,line",
    [
        ({"MASTER_ADDR": FAR}, 1, f"MASTER_ADDR={FAR} (environment) is not an address of this machine, {ONE_MACHINE}"),
        ({"MASTER_ADDR": FAR, "MASTER_PORT": "29555"}, 1, f"MASTER_ADDR={FAR} (environment) is not an address of"),
        ({"MASTER_ADDR": "x.invalid"}, 1, f"MASTER_ADDR=x.invalid (environment) does not resolve to an address"
         f", {ONE_MACHINE}"),
        ({"NODE_RANK": "1", "MASTER_PORT": "29555"}, 2, f"{NODES} MASTER_ADDR not set: {BY_HAND}"),
        ({"NODE_RANK": "1", "MASTER_ADDR": FAR}, 2, f"{NODES} MASTER_PORT not set: {BY_HAND}"),
        ({}, 2, f"{NODES} MASTER_ADDR and MASTER_PORT not set: {BY_HAND}"),
        (
            {"MASTER_ADDR": FAR, "MASTER_PORT": "29555"},
            2,
            "MASTER_ADDR=198.18.255.1 (environment) is not an address of this machine, but this is node 0 (NODE_RANK "
            "unset or 0), which serves the rendezvous: give every node this machine's address as MASTER_ADDR, or set "
            "NODE_RANK to this node's rank",
        ),
    ],
)  # fmt: skip
def test_stray_or_partial_address_variables_are_named_for_what_they_are(monkeypatch, env, nodes, line):
    """An address left in the shell that is not this machine's (blamed on the port before), one that does not
    resolve, and a multi-node run by hand missing one of the pair: one line naming the variable and advice that
    works, before any rank starts."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg("strategy=ddp", f"devices={3 - nodes}", f"num_nodes={nodes}", "accelerator=cpu"))
    assert str(err.value).startswith(line)


@pytest.mark.parametrize(
    "env,settings,world",
    [
        ({"MASTER_ADDR": "127.0.0.1"}, ["strategy=ddp", "devices=2"], (2, 1)),
        ({"MASTER_ADDR": "localhost", "MASTER_PORT": "29555"}, ["strategy=ddp", "devices=2"], (2, 1)),
        ({"MASTER_PORT": "29555"}, ["strategy=ddp", "devices=2"], (2, 1)),  # a port chosen for the run: the store's
        ({"MASTER_ADDR": FAR}, ["strategy=auto"], (1, 1)),  # one process: no rendezvous
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}, ["strategy=ddp", "devices=1", "num_nodes=2"], (2, 2)),
    ],
)
def test_address_variables_a_run_can_use_are_accepted(monkeypatch, env, settings, world):
    """The check passes, and the run's world (processes, nodes) is the settings', with this process the writer."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    found = check_config(compose_cfg(*settings, "accelerator=cpu")).world
    assert (found.world_size, found.nodes, found.global_rank, found.writes_outputs) == (*world, 0, True)


def test_partial_kubeflow_rank_variables_are_refused_naming_the_missing_ones(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="^cluster=kubeflow but MASTER_ADDR, MASTER_PORT not set"):
        check_config(compose_cfg("strategy=ddp", "devices=1", "num_nodes=2", "accelerator=cpu", "cluster=kubeflow"))


@pytest.mark.parametrize("strategy", ["auto", "dp"])
def test_a_launcher_world_above_one_under_a_one_process_strategy_is_refused(monkeypatch, strategy):
    """Several launched processes that would each train alone into one directory (``torchrun --nproc_per_node=2
    train.py`` without strategy=ddp): one line, on every process, before anything trains."""
    for key, value in {"TORCHELASTIC_RUN_ID": "r", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(f"strategy={strategy}", "accelerator=cpu"))
    assert str(err.value).startswith(f"the cluster started 2 processes (torchrun WORLD_SIZE=2) but strategy={strategy}")
    assert str(err.value).endswith("use strategy=ddp with devices x num_nodes = 2")


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=30))
def test_any_directory_name_survives_hydras_override_parser(name):
    """A generated command quoted for the shell but not for Hydra fails in Hydra's parser at a space: the printed
    resume command quotes each value for Hydra, then for the shell, for any directory name."""
    parsed = OverridesParser.create().parse_override(f"hydra.run.dir={hydra_value(name)}")
    assert parsed.value() == name


def test_the_printed_resume_command_parses_back_to_the_run_directory(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "my run é, it's"
    monkeypatch.setattr(sys, "argv", ["train.py", "strategy=ddp", "devices=2", "hydra.run.dir=old"])
    command = _resume_command(["strategy=ddp", "devices=2", "hydra.run.dir=old"], run_dir, multirun=False)
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"] and argv[2:5] == ["strategy=ddp", "devices=2", "resume=true"]
    parsed = OverridesParser.create().parse_overrides(argv[2:])
    assert parsed[-1].key_or_group == "hydra.run.dir" and parsed[-1].value() == str(run_dir)


@pytest.mark.slow
def test_resume_without_naming_the_run_is_refused(tmp_path, monkeypatch, capfd):
    """A resume request that would silently start fresh (``resume=true`` alone: a new time-stamped directory) is
    refused in one line that says how to name the run (train.py's calls in this process)."""
    assert train_py_here("resume=true", cwd=tmp_path, monkeypatch=monkeypatch) == 2
    assert [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")] == [
        "error: resume=true needs the run to resume: add hydra.run.dir=<its directory> "
        "(e.g. hydra.run.dir=outputs/2026-01-31/12-00-00)"
    ]
    assert list(tmp_path.iterdir()) == []  # refused before Hydra makes the run's directory


def _train_py(tmp_path, *args, **env):
    full, _ = child_env(**env)
    cmd = [sys.executable, str(ROOT / "train.py"), *args, "trainer.enable_progress_bar=false"]
    return subprocess.run(cmd, cwd=tmp_path, env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,env",
    [
        (["hydra.run.dir=run"], {}),  # a named directory used twice
        (
            [],
            {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"},
        ),
    ],
    ids=["named", "static-torchrun"],
)
def test_a_second_run_never_writes_into_another_runs_directory(tmp_path, monkeypatch, args, env):
    """One run's outputs overwritten by another's (a named directory used twice; a static torchrun run id): the
    second run is refused in one line (exit 2) and the first run's files are untouched; resume=true continues
    the first run. The refused run is a train.py process; the first run and the continue run train.py's calls in
    this process, under the launcher's variables where the row has them (a world of one: no process group)."""

    def trained(*more: str) -> None:
        with monkeypatch.context() as launcher:
            for key, value in env.items():
                launcher.setenv(key, value)
            assert train_py_here(*more, cwd=tmp_path, monkeypatch=monkeypatch) == 0
        assert not torch.distributed.is_initialized()

    trained("trainer.max_epochs=1", *args)
    (run,) = {p.parent.parent for p in tmp_path.rglob("checkpoints/last.ckpt")}
    before = (run / "checkpoints/last.ckpt").read_bytes(), (run / "metrics.json").read_text()
    second = _train_py(tmp_path, "trainer.max_epochs=1", *args, **env)
    assert second.returncode == 2
    lines = [x for x in second.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "holds another run (last.ckpt, metrics.json): continue it with resume=true" in lines[0]
    assert ((run / "checkpoints/last.ckpt").read_bytes(), (run / "metrics.json").read_text()) == before
    named = args or [f"hydra.run.dir={run}"]
    trained("trainer.max_epochs=2", *named, "resume=true")


@pytest.mark.slow
def test_resuming_a_finished_run_at_its_own_limit_trains_nothing_and_rewrites_nothing(tmp_path, monkeypatch, capfd):
    """A finished run resumed with the same trainer.max_epochs: one line says there is nothing to train, exit 0,
    and last.ckpt (its epoch: the straight run's) and metrics.json are unchanged (it re-ran and wrote epoch 2 over
    1 before). Both runs are train.py's calls in this process (with its curves default); what they print, the
    log's lines included, is read from this process's streams."""
    args = ["trainer.max_epochs=2", "data.num_samples=300", "hydra.run.dir=run", "logger=none", "curves=true"]
    assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    capfd.readouterr()
    run = tmp_path / "run"
    before = (run / "checkpoints/last.ckpt").read_bytes(), (run / "metrics.json").read_text()
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["epoch"] == 1
    code, (out, err) = train_py_here(*args, "resume=true", cwd=tmp_path, monkeypatch=monkeypatch), capfd.readouterr()
    assert code == 0, err[-2000:]
    said = [x for x in (out + err).splitlines() if "nothing to train" in x]
    assert len(said) == 1 and "is already at trainer.max_epochs=2; raise it to continue the run" in said[0]
    assert "continuing finished job" not in out + err
    assert ((run / "checkpoints/last.ckpt").read_bytes(), (run / "metrics.json").read_text()) == before


@pytest.mark.parametrize("limit_gib", [24, 8])
def test_the_memory_check_counts_what_the_run_holds_and_its_advice_passes(monkeypatch, limit_gib):
    """A memory check whose estimate and advice must match the run: 8192 x 1,000,000 features is 30 GiB in memory,
    and streaming blocks of 16 GiB do not fit either; the advice (a feature count) passes the same check, on this
    machine's size or a container's limit."""
    from dpddp.run import config

    monkeypatch.setattr(config, "memory_bytes", lambda: limit_gib * 2**30)
    big = ["trainer.max_epochs=1", "data.num_samples=8192", "data.num_features=1000000"]
    for streaming in ("false", "true"):
        with pytest.raises(ConfigError) as err:
            check_config(compose_cfg(*big, f"data.streaming={streaming}"))
        line = str(err.value)
        assert f"more than 80% of the {limit_gib:.1f} GiB this machine or container allows" in line
        features = int(line.rsplit("lower data.num_features to at most ", 1)[1])
        check_config(compose_cfg(*big[:2], f"data.num_features={features}", f"data.streaming={streaming}"))


def test_the_memory_check_counts_every_process_on_the_node(monkeypatch):
    """Each DDP process builds its own copy: what fits one process may not fit four; streaming then fits."""
    from dpddp.run import config

    monkeypatch.setattr(config, "memory_bytes", lambda: 8 * 2**30)
    args = ["data.num_samples=1000000", "data.num_features=500", "accelerator=cpu"]
    check_config(compose_cfg(*args))  # one process: about 2.5 GiB
    with pytest.raises(ConfigError, match="with 4 process\\(es\\) per node need about .*: set data.streaming=true"):
        check_config(compose_cfg(*args, "strategy=ddp", "devices=4"))
    check_config(compose_cfg(*args, "strategy=ddp", "devices=4", "data.streaming=true"))


@pytest.mark.parametrize(
    "argv,line",
    [
        (["experiment=nope"], "experiment=nope is unknown: choose one of compute_heavy"),
        (["debug=fast_dev_rn"], "debug=fast_dev_rn is unknown (did you mean fast_dev_run?): choose one of"),
        (["-m", "data=default,digts"], "data=digts is unknown (did you mean digits?): choose one of breast_cancer"),
        (["data=digits", "model=mlp", "experiment=compute_heavy", "strategy=ddp", "strategy.timeout_s=9"], None),
        (["data=choice(default,digts)"], None),  # a sweep function: Hydra's own check
    ],
)
def test_an_unknown_config_option_is_named_before_hydra_starts(argv, line):
    """Found by the fresh-user trial: optional groups (experiment=, debug=) ignored an unknown option silently."""
    from dpddp.entry.hydra import unknown_option

    got = unknown_option(argv)
    assert got == line if line is None else got is not None and got.startswith(line)


def test_an_unknown_preset_exits_2_in_one_line(tmp_path, monkeypatch, capfd):
    assert train_py_here("experiment=nope", cwd=tmp_path, monkeypatch=monkeypatch) == 2
    assert [x for x in capfd.readouterr().err.splitlines() if x.strip()] == [
        "error: experiment=nope is unknown: choose one of compute_heavy"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv,program",
    [
        (["/venv/bin/dpddp-train", "--config-dir", "conf", "model=mine"], ["dpddp-train", "--config-dir", "conf"]),
        (
            ["/proj/train.py", "-cd=conf", "-cn", "mine", "seed=1"],
            ["python", "/proj/train.py", "-cd=conf", "-cn", "mine"],
        ),
        (["train.py", "seed=1"], ["python", "train.py"]),
    ],
)
def test_the_printed_resume_command_starts_the_program_as_it_was_started(tmp_path, monkeypatch, argv, program):
    """The installed command by its name, a file by the path typed, and Hydra's config options kept: a user's own
    project has no train.py, and its configs are found only through ``--config-dir``."""
    monkeypatch.setattr(sys, "argv", argv)
    command = shlex.split(_resume_command(["model=mine"], tmp_path, multirun=False))
    assert command[: len(program)] == program and command[len(program)] == "model=mine"

"""The console scripts: dpddp-check (--env: a block for a bug report), dpddp-plot, dpddp-eval, with --help."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env

from dpddp.plot import main as plot_main

BIN = Path(sys.executable).parent


def _script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env, _ = child_env()
    return subprocess.run([str(BIN / name), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_dpddp_check_env_prints_a_block_to_paste(tmp_path):
    env, _ = child_env(MASTER_PORT="29555")
    proc = subprocess.run(
        [str(BIN / "dpddp-check"), "--env"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[:3] == ["Paste this into your bug report:", "", "```text"] and lines[-1] == "```"
    assert lines[3] == f"platform: {platform.platform()}"
    assert lines[4].startswith(f"versions: Python {platform.python_version()}, torch {torch.__version__}, lightning")
    assert lines[5].startswith("devices: ") and lines[6].startswith("network: ")
    assert lines[7].startswith("launcher variables: MASTER_PORT=29555") and len(lines) == 9
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


def test_each_console_script_has_help(tmp_path):
    """(dpddp-check's --help is argparse's, as its --env above shows the script runs; dpddp-eval's: test_eval.)"""
    for name in ("dpddp-plot",):
        proc = _script(name, "--help", cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: "), (name, proc.stderr[-1000:])


def test_dpddp_plot_of_nothing_to_plot_is_one_line_exit_2_and_draws_nothing(tmp_path, capsys):
    """An evaluation run's directory (a metrics.csv without a fit's epochs), a path that does not exist, a file."""
    (tmp_path / "metrics.csv").write_text("stage,epoch,test/loss\ntest,0,0.5\n")
    (tmp_path / "notes.txt").write_text("")
    said = {
        tmp_path: f"nothing to plot in {tmp_path}: its metrics.csv has no epoch of a fit (an evaluation run's has "
        "none): give a run or sweep directory that trained",
        tmp_path / "gone": f"{tmp_path / 'gone'} does not exist: give a run directory or a sweep directory (with "
        "metrics.csv files)",
        tmp_path / "notes.txt": f"{tmp_path / 'notes.txt'} is not a directory: give a run directory or a sweep "
        "directory (with metrics.csv files)",
    }
    for path, line in said.items():
        with pytest.raises(SystemExit) as ended:
            plot_main([str(path)])
        assert ended.value.code == 2 and capsys.readouterr() == ("", f"error: {line}\n"), path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "notes.txt"]  # no curves.png

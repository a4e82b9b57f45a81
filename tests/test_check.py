"""``python -m dpddp.check``: the report's parts, promise 1 measured on the user's model, and its exit status."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT, child_env

from dpddp.check import TOLERANCE, _compose, overrides_of


def _check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env, _ = child_env(PYTHONPATH=str(ROOT / "tests"))
    return subprocess.run(
        [sys.executable, "-m", "dpddp.check", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _rows(stdout: str) -> dict[str, list[str]]:
    """The samples/s table's rows by training name: samples/s, scaling, peak MiB, all-reduce, steps, difference."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"(1 process|ddp\(2\)|dp\(\d+\))\s+(.*)$", line)
        if m:
            found[m.group(1)] = m.group(2).split()
    return found


def test_the_overrides_of_model_and_data():
    assert overrides_of("model", ["mlp", "hidden=[64]", "+p=0.3", "model.lr=0.1"]) == [
        "model=mlp",
        "model.hidden=[64]",
        "+model.p=0.3",
        "model.lr=0.1",
    ]
    assert overrides_of("data", ["digits", "+data.x=1"]) == ["data=digits", "+data.x=1"]


def test_a_config_dir_of_the_users_own_is_composed(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("_target_: dpddp.models.linear.LinearClassifier\nlr: 0.25\n")
    cfg = _compose(overrides_of("model", ["mine"]), str(tmp_path))
    assert (cfg.model._target_, cfg.model.lr, cfg.trainer.max_epochs) == (
        "dpddp.models.linear.LinearClassifier",
        0.25,
        2,
    )


@pytest.mark.slow
def test_the_check_passes_here_and_prints_its_parts():
    proc = _check()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    versions = r"^versions: Python 3\.\d+\.\d+, torch \S+, lightning 2\.\S+, hydra-core 1\.3\.\S+, dpddp \S+$"
    assert re.search(versions, out, re.M)
    assert re.search(r"^devices: \d+ CPU cores usable .*; GPUs: ", out, re.M)
    assert re.search(r"^network: .*GLOO_SOCKET_IFNAME|^network: no local interface", out, re.M)
    assert re.search(r"^launcher variables: ", out, re.M)
    rows = _rows(out)
    assert {"1 process", "ddp(2)"} <= rows.keys()
    one, ddp = rows["1 process"], rows["ddp(2)"]
    assert float(one[-1]) == 0.0 and float(ddp[-1]) <= TOLERANCE  # the largest weight difference
    assert one[4] == ddp[4] == "102"  # the same global step: 2 epochs of 51
    speeds = [float(row[0].replace(",", "")) for row in (one, ddp)]
    assert min(speeds) > 0 and one[1] == "100%"
    assert int(ddp[1].rstrip("%")) == round(100 * speeds[1] / (2 * speeds[0]))  # scaling efficiency on 2
    assert one[3] == "-" and re.fullmatch(r"\d+%", ddp[3])  # the all-reduce share: ddp only
    assert "promise 1 (ddp and dp end with one process's weights to 1e-05 and its step): holds" in out
    assert re.search(r"^advice: (one process|ddp\(2\)) is fastest here for this model size", out, re.M)
    assert proc.stderr.strip() == ""


@pytest.mark.slow
def test_a_model_drawing_from_the_global_stream_fails_the_check_in_one_line():
    proc = _check("--model", "mlp", "--model", "_target_=users_models.GlobalDropoutMLP")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.fullmatch(
        r"error: promise 1 does not hold for this model: ddp\(2\) ends \S+ from one process's weights \(tolerance "
        r"1e-05; the largest in net\.\d+\.(weight|bias)\); model\.drop draws from the global random stream: "
        r"use dpddp\.nn\.SampleDropout",
        lines[0],
    )
    assert float(_rows(proc.stdout)["ddp(2)"][-1]) > 1e-3
    assert "does NOT hold" in proc.stdout


def test_a_bad_override_is_one_line_and_exit_2_before_training():
    proc = _check("--model", "nosuch")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: In 'config': Could not find 'model/nosuch': choose one of default, mlp"
    assert "samples/s" not in proc.stdout

"""The package as its peers ship: typed (PEP 561), licensed, test tools apart from the runtime extras."""

import subprocess
import sys
from importlib.metadata import metadata, requires
from importlib.resources import files

import pytest
from conftest import QUIET, ROOT, compose_cfg
from omegaconf import OmegaConf
from PIL import Image

from dpddp.errors import ConfigError
from dpddp.report.curves import curves
from dpddp.run.config import check_config
from dpddp.run.training import train

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


@pytest.mark.slow
def test_a_users_mypy_sees_dpddps_annotations(tmp_path):
    """With ``py.typed``, a user's mypy reads ``dpddp.nn``'s annotations (without it: "missing library stubs or
    py.typed marker", and every name is Any). torch is not followed, to keep this to about 2 s."""
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\n[mypy-torch.*,lightning.*,numpy.*,torchmetrics.*]\nfollow_imports = skip\n"
    )
    (tmp_path / "user.py").write_text(
        "from dpddp.nn import SampleDropout\n\nreveal_type(SampleDropout.forward)\nSampleDropout.layer_key = 'first'\n"
    )
    cmd = [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir=/dev/null", "user.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert 'Revealed type is "def (self: dpddp.nn.SampleDropout, input: Any) -> Any"' in proc.stdout, proc.stdout
    assert 'has type "str", variable has type "int | None"' in proc.stdout and proc.returncode == 1
    assert "py.typed" not in proc.stdout
    assert files("dpddp").joinpath("py.typed").is_file()


def test_license_extras_and_test_tools():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert metadata("dpddp")["License-Expression"] == "MIT"
    extras = project["optional-dependencies"]
    runtime = sorted(set(extras) - {"all", "test", "dev"})
    assert sorted(extras["all"][0].removeprefix("dpddp[").removesuffix("]").split(",")) == runtime
    assert extras["dev"] == ["dpddp[test,all]"]
    tools = {r.split(">")[0] for r in extras["test"]}
    assert {"pytest", "ruff", "mypy"} <= tools
    assert not tools & {r.split(">")[0] for name in runtime for r in extras[name]}  # apart from the runtime extras


def test_matplotlib_is_a_dependency_and_every_run_draws_its_curves(tmp_path):
    """A default install draws ``curves.png`` (matplotlib is no extra): loss, accuracy, samples/s and memory."""
    assert any(r.startswith("matplotlib") and "extra" not in r for r in requires("dpddp") or [])
    assert OmegaConf.load(ROOT / "src/dpddp/conf/config.yaml").curves is True  # drawn unless curves=false
    small = [*QUIET, "accelerator=cpu", "data.num_samples=400", "trainer.max_epochs=2"]
    train(compose_cfg(*small, "curves=false"), tmp_path / "none")
    assert (tmp_path / "none/metrics.json").is_file() and not (tmp_path / "none/curves.png").exists()
    with pytest.raises(ConfigError, match=r"^curves='maybe' is not a switch: use curves=true or curves=false$"):
        check_config(compose_cfg(*small, "curves=maybe"))
    train(compose_cfg(*small, "curves=true"), tmp_path)
    series = curves(tmp_path)[tmp_path.name]
    for key in ("train/loss", "val/loss", "val/acc", "samples_per_sec", "peak_mem_mib"):
        assert [epoch for epoch, _ in series[key]] == [0, 1], key
    assert Image.open(tmp_path / "curves.png").size == (1000, 700)  # 2 x 2 panels, no legend for one run

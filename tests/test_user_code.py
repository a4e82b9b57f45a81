"""A user's own model next to their copy of train.py: every launched rank imports it (as rank 0 does), and the job a
launched rank receives round-trips through its environment."""

import shutil
import subprocess
import sys

import pytest
from conftest import QUIET, ROOT, child_env, leftover, metrics

from dpddp.parallel.launcher import RankJob

USER_MODEL = '''
from dpddp.models.linear import LinearClassifier


class WiderNet(LinearClassifier):
    """A user's model: the built-in one, under the user's own module name."""
'''


def test_rank_job_round_trips_through_the_environment(tmp_path):
    job = RankJob(entry="pkg.mod:fn", config={"devices": 2, "data": {"seed": 0}}, output_dir=str(tmp_path))
    env = job.to_env()
    assert list(env) == [RankJob.ENV]
    back = RankJob.from_env(env)
    assert back == job and back.sys_path == tuple(sys.path) and back.cwd == job.cwd
    with pytest.raises(KeyError):
        RankJob.from_env({})


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_launched_ranks_import_a_user_module_next_to_train_py_run_from_elsewhere(tmp_path, launch):
    """Launched ranks that must see rank 0's import path: ``python proj/train.py model._target_=mine.WiderNet
    strategy=ddp devices=2`` from another directory: rank 0 imports ``mine`` from the script's directory; so does every
    launched rank."""
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(ROOT / "train.py", proj / "train.py")
    (proj / "mine.py").write_text(USER_MODEL)
    env, tag = child_env()
    args = ["model._target_=mine.WiderNet", "strategy=ddp", "devices=2", f"strategy.launch={launch}"]
    args += ["accelerator=cpu", "trainer.max_epochs=2", "hydra.run.dir=run", *QUIET]
    cmd = [sys.executable, "proj/train.py", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics(tmp_path / "run")["world_size"] == 2 and metrics(tmp_path / "run")["val/acc"] > 0.9
    assert leftover(tag) == []

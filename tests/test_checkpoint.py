import logging

import pytest
import torch
from conftest import compose_cfg

from dpddp.continuity.io import AtomicCheckpointIO, checkpoint_problem


def test_a_write_cut_short_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)

    def killed_mid_write(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04half a file")
        raise KeyboardInterrupt  # stands for the SIGKILL that would end the process here

    monkeypatch.setattr(torch, "save", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    assert checkpoint_problem(path) is None
    assert torch.load(path, weights_only=True)["global_step"] == 1


@pytest.mark.parametrize(
    "overrides,warned",
    [
        ([], False),
        (["~callbacks.last_checkpoint"], True),
        (["~callbacks"], True),  # Lightning's own default checkpoint: epoch=N-step=M.ckpt, no last.ckpt
        (
            [
                "callbacks.last_checkpoint=null",
                "+callbacks.mine._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                "+callbacks.mine.save_last=true",
            ],
            False,
        ),  # fmt: skip
        (["debug=profiler"], False),  # trainer.enable_checkpointing=false: no checkpoint wanted
    ],
)
def test_a_run_without_a_last_ckpt_each_epoch_is_warned_that_a_kill_cannot_be_continued(
    tmp_path, caplog, overrides, warned
):
    from dpddp.parallel.rules import world_of
    from dpddp.run.assembly import build_trainer

    with caplog.at_level(logging.WARNING, logger="dpddp.run.assembly"):
        cfg = compose_cfg("accelerator=cpu", *overrides)
        build_trainer(cfg, world_of(cfg), tmp_path)
    said = [r.getMessage() for r in caplog.records if "no callback writes checkpoints/last.ckpt" in r.getMessage()]
    assert len(said) == int(warned), said

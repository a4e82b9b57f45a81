import pytest
import torch

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

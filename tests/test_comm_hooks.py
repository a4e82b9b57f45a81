"""``strategy.ddp_comm_hook``: torch's 16-bit all-reduce hooks and PowerSGD by name, each with a tested bound on the
drift from the 32-bit all-reduce, the all-reduce share still reported; PowerSGD's state continues exactly; the
hooks a machine cannot run, and bad PowerSGD settings, are one line."""

import json

import pytest
from conftest import compose_cfg, global_step, made_once, max_diff, run_train, weights

from dpddp.errors import ConfigError
from dpddp.parallel.rules import check_strategy_options
from dpddp.run.config import check_config

DDP = ["accelerator=cpu", "strategy=ddp", "devices=2", "data.num_samples=1005", "trainer.max_epochs=3"]
FP16_BOUND = 1e-3
"""fp16_compress against no hook, ddp(2), 3 epochs of the linear model: the largest weight difference (measured
1.5e-4 here; each gradient all-reduced in 16 bits is rounded to 2**-11 of itself)."""

POWERSGD_BOUND = 0.1
"""powersgd (rank 1, compressing from step 10 of 36) against no hook, ddp(2), 3 epochs of the linear model: the
largest weight difference (measured 3.9e-2 here; the 4x16 weight's gradient goes as rank-1 factors, its error
fed back into the next step; the bias is all-reduced whole)."""


BF16_BOUND = 5e-3
"""bf16_compress against no hook, the same run: the largest weight difference (measured 7.5e-4 here, on gloo; bf16
keeps 8 bits of mantissa, fp16 11: each gradient is rounded to 2**-8 of itself)."""


def _plain(shared_dir):
    """The hook-free ddp(2) run (``strategy.ddp_comm_hook=null``, the default) both tests compare to, run once a
    session: its ``last.ckpt``."""

    def make(path):
        run_train(*DDP, "strategy.ddp_comm_hook=null", f"hydra.run.dir={path}", cwd=path.parent, check=True)

    return made_once(shared_dir, "comm_hooks_plain", make) / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_16_bit_compression_stays_within_its_bound_of_the_32_bit_all_reduce(tmp_path, shared_dir):
    for hook in ("fp16_compress", "bf16_compress"):
        run_train(*DDP, f"strategy.ddp_comm_hook={hook}", f"hydra.run.dir=run-{hook}", cwd=tmp_path, check=True)
    plain = weights(_plain(shared_dir))
    fp16, bf16 = (
        weights(tmp_path / f"run-{d}" / "checkpoints" / "last.ckpt") for d in ("fp16_compress", "bf16_compress")
    )
    assert 0 < max_diff(plain, fp16) <= FP16_BOUND  # compressed: not the same sums, and within the bound
    assert max_diff(plain, fp16) < max_diff(plain, bf16) <= BF16_BOUND  # fewer mantissa bits: further, in its bound
    for hook in ("fp16_compress", "bf16_compress"):
        metrics = json.loads((tmp_path / f"run-{hook}" / "metrics.json").read_text())
        assert 0 < metrics["allreduce_share"] < 1  # the hook timed as the plain all-reduce is


@pytest.mark.parametrize(
    "value,line",
    [
        (
            "powersgd strategy.powersgd_start_iter=1",
            "strategy.powersgd_start_iter=1 is invalid: use 2 or more (plain all-reduce before it), e.g. 10",
        ),
        (
            "powersgd strategy.powersgd_rank=0",
            "strategy.powersgd_rank=0 is invalid: use a small rank, e.g. 1, 2 or 4",
        ),
        (
            "topk",
            "strategy.ddp_comm_hook='topk' is unknown: use null, fp16_compress, bf16_compress or powersgd",
        ),
    ],
)
def test_a_comm_hook_this_machine_cannot_run_is_one_line(value, line):
    with pytest.raises(ConfigError) as err:
        hook, *rest = value.split()
        check_config(compose_cfg(*DDP, f"strategy.ddp_comm_hook={hook}", *rest))
    assert str(err.value) == line


def test_a_comm_hook_given_as_a_list_is_one_line_too():
    """The command line checks ``strategy=auto strategy.ddp_comm_hook=[topk]``'s plain value (auto has no such key)."""
    with pytest.raises(ConfigError) as err:
        check_strategy_options({"ddp_comm_hook": ["topk"]})
    assert (
        str(err.value)
        == "strategy.ddp_comm_hook=['topk'] is unknown: use null, fp16_compress, bf16_compress or powersgd"
    )


@pytest.mark.slow
def test_powersgd_stays_within_its_bound_and_a_stopped_run_continues_exactly(tmp_path, shared_dir):
    """The hook-free and the PowerSGD ddp(2) runs, and the PowerSGD run stopped at step 20 (compressing since step
    10) and continued: its error feedback, P/Q memories, count and generator come back, in the bucket layout they
    were kept in."""
    hook = "strategy.ddp_comm_hook=powersgd"
    run_train(*DDP, hook, "hydra.run.dir=powersgd", cwd=tmp_path, check=True)
    run_train(*DDP, hook, "trainer.max_steps=20", "hydra.run.dir=run", cwd=tmp_path, check=True)
    run_train(*DDP, hook, "resume=true", "hydra.run.dir=run", cwd=tmp_path, check=True)
    plain = weights(_plain(shared_dir))
    straight, continued = (weights(tmp_path / d / "checkpoints" / "last.ckpt") for d in ("powersgd", "run"))
    drift = max_diff(plain, straight)
    assert 0 < drift <= POWERSGD_BOUND
    assert max_diff(straight, continued) <= 1e-6
    assert global_step(tmp_path / "run") == global_step(tmp_path / "powersgd") == 36
    assert 0 < json.loads((tmp_path / "powersgd" / "metrics.json").read_text())["allreduce_share"] < 1


def test_bf16_compression_over_gloo_on_gpus_is_one_line(monkeypatch):
    """gloo all-reduces bf16 CPU tensors but not CUDA ones: with GPUs and an explicit gloo backend, one line."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ConfigError) as err:
        check_strategy_options({"ddp_comm_hook": "bf16_compress", "process_group_backend": "gloo"})
    assert str(err.value) == (
        "strategy.ddp_comm_hook=bf16_compress with strategy.process_group_backend=gloo cannot all-reduce bf16 GPU "
        "gradients: use process_group_backend=null (NCCL on GPUs) or nccl, or fp16_compress"
    )
    check_strategy_options({"ddp_comm_hook": "bf16_compress", "process_group_backend": None})

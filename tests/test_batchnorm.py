"""BatchNorm over the global batch (``dpddp.parallel.batchnorm``): the layer equals ``nn.BatchNorm*`` on one
process and one process on the concatenated global batch over 2 and 3 gloo processes; conversion keeps the
state_dict; the plugin decision; ``train.py`` under ddp(2) ends with one process's weights and running stats."""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg, free_port
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn

from dpddp.errors import ConfigError
from dpddp.parallel import batchnorm
from dpddp.parallel.batchnorm import BatchNormSync, GlobalBatchNorm, batchnorm_plugins, convert, revert
from dpddp.parallel.rules import world_of
from dpddp.run.assembly import build_trainer
from dpddp.run.training import train

TOL = 1e-5
STEPS = 3
# name: (layer class, global input shape, momentum); "one_each": one sample per process
CASES = {
    "1d": (nn.BatchNorm1d, (12, 5), 0.1),
    "1d_seq": (nn.BatchNorm1d, (6, 4, 3), 0.1),
    "1d_uneven": (nn.BatchNorm1d, (7, 3), 0.3),
    "1d_one_each": (nn.BatchNorm1d, (0, 4), 0.1),
    "2d": (nn.BatchNorm2d, (6, 3, 4, 5), 0.1),
    "2d_cumulative": (nn.BatchNorm2d, (6, 2, 3, 3), None),
    "3d": (nn.BatchNorm3d, (6, 2, 2, 3, 2), 0.1),
}


def _layer(case: str) -> nn.Module:
    cls, shape, momentum = CASES[case]
    layer = cls(shape[1], momentum=momentum)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.3 * torch.randn(shape[1], generator=g))
        layer.bias.copy_(0.3 * torch.randn(shape[1], generator=g))
    return layer


def _batch(case: str, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch (channel means far from 0, scales far from 1) and the upstream gradient of its output."""
    shape = list(CASES[case][1])
    shape[0] = shape[0] or world
    g = torch.Generator().manual_seed(100 * step + len(case))
    centre = 3 * torch.randn([1, shape[1]] + [1] * (len(shape) - 2), generator=g)
    x = centre + (1 + step) * torch.randn(shape, generator=g)
    return x, torch.randn(shape, generator=g)


def _run_steps(layer: nn.Module, case: str, world: int, rank: int, reduce=None) -> dict[str, list[torch.Tensor]]:
    """STEPS training steps on this rank's chunk of each global batch, then an eval forward; the loss is scaled
    so that the DDP average of the ranks' losses is one process's ``sum(out * upstream) / N``."""
    out: dict[str, list[torch.Tensor]] = {"out": [], "grad_x": [], "grad_w": [], "grad_b": [], "eval": []}
    for step in range(STEPS + 1):
        x, up = _batch(case, step, world)
        x, up = x.tensor_split(world)[rank].clone().requires_grad_(), up.tensor_split(world)[rank]
        layer.train(step < STEPS)
        layer.zero_grad()
        y = layer(x)
        if step == STEPS:
            out["eval"].append(y.detach())
            break
        (world * (y * up).sum() / len(_batch(case, step, world)[0])).backward()
        grads = [layer.weight.grad.clone(), layer.bias.grad.clone()]
        if reduce is not None:
            for grad in grads:
                reduce(grad)
        out["out"].append(y.detach())
        out["grad_x"].append(x.grad / world)
        out["grad_w"].append(grads[0] / world)
        out["grad_b"].append(grads[1] / world)
    out["running"] = [layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked.clone()]
    return out


def _one_process_of(case: str, world: int) -> dict[str, list[torch.Tensor]]:
    """One ``nn.BatchNorm*`` on the whole global batch of a ``world``-process run (one-each: ``world`` samples)."""
    layer, ref = _layer(case), {"out": [], "grad_x": [], "grad_w": [], "grad_b": [], "eval": []}
    for step in range(STEPS + 1):
        x, up = _batch(case, step, world)
        x = x.clone().requires_grad_()
        layer.train(step < STEPS)
        layer.zero_grad()
        y = layer(x)
        if step == STEPS:
            ref["eval"].append(y.detach())
            break
        ((y * up).sum() / len(x)).backward()
        ref["out"].append(y.detach())
        ref["grad_x"].append(x.grad.clone())
        ref["grad_w"].append(layer.weight.grad.clone())
        ref["grad_b"].append(layer.bias.grad.clone())
    ref["running"] = [layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked.clone()]
    return ref


def _max_diff(got: dict[str, list[torch.Tensor]], ref: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    return {
        key: max(
            (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            for a, b in zip(got[key], ref[key], strict=True)
        )
        for key in ref
    }


# One process


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_layer_on_one_process_is_nn_batchnorm(case):
    """No process group: nn.BatchNorm's own forward, in train and eval."""
    if case == "1d_one_each":
        return
    layer = convert(_layer(case))
    assert type(layer) is GlobalBatchNorm
    diff = _max_diff(_run_steps(layer, case, 1, 0), _one_process_of(case, 1))
    assert all(d == 0 for d in diff.values()), diff


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_synced_computation_on_one_process_is_nn_batchnorm(case, monkeypatch):
    """The global-statistics path itself (a group of one that says it has two, its sums its own): outputs,
    gradients of input and parameters, running statistics and the eval output equal nn.BatchNorm's."""
    if case == "1d_one_each":
        return
    monkeypatch.setattr(batchnorm, "_group_size", lambda group: 2)
    monkeypatch.setattr(batchnorm.dist, "all_reduce", lambda tensor, group=None: None)
    diff = _max_diff(_run_steps(convert(_layer(case)), case, 1, 0), _one_process_of(case, 1))
    assert max(diff.values()) <= TOL, diff


def test_a_global_batch_of_one_value_per_channel_is_refused_as_nn_batchnorm_refuses_it(monkeypatch):
    monkeypatch.setattr(batchnorm, "_group_size", lambda group: 2)
    monkeypatch.setattr(batchnorm.dist, "all_reduce", lambda tensor, group=None: None)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training, got 1 in the global"):
        GlobalBatchNorm(3)(torch.randn(1, 3))
    assert GlobalBatchNorm(3)(torch.randn(1, 3, 2)).shape == (1, 3, 2)  # two values per channel


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_without_num_batches_tracked_update_as_nn_batchnorm(momentum, monkeypatch):
    """A layer whose ``num_batches_tracked`` is None (nn.BatchNorm takes it: factor momentum, or 0 when None)."""
    monkeypatch.setattr(batchnorm, "_group_size", lambda group: 2)
    monkeypatch.setattr(batchnorm.dist, "all_reduce", lambda tensor, group=None: None)
    ref, x = nn.BatchNorm1d(3, momentum=momentum), 2 + 3 * torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    ref.num_batches_tracked = None
    layer = convert(copy.deepcopy(ref))
    for module in (ref, layer):
        module(x)
    assert layer.num_batches_tracked is None
    assert torch.allclose(layer.running_mean, ref.running_mean) and torch.allclose(layer.running_var, ref.running_var)
    assert torch.equal(ref.running_mean, torch.zeros(3)) == (momentum is None)  # momentum None: factor 0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.BatchNorm1d(4)
        self.body = nn.Sequential(nn.Linear(3, 4), shared, nn.ReLU(), nn.Linear(4, 4), shared)
        self.conv = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2, affine=False, momentum=None))
        self.sync = nn.SyncBatchNorm(4, track_running_stats=False)
        self.no_bias = nn.BatchNorm1d(4, bias=False)


def test_convert_and_revert_keep_parameters_buffers_and_state_dict_keys():
    net = _Net()
    before = {name: type(m) for name, m in net.named_modules()}
    tensors = {k: v for k, v in net.state_dict(keep_vars=True).items()}
    converted = convert(net)
    assert converted is net and net.body[1] is net.body[4]  # shared stays shared
    assert [type(m) for m in (net.body[1], net.conv[1], net.sync, net.no_bias)] == [GlobalBatchNorm] * 4
    state = net.state_dict(keep_vars=True)
    assert state.keys() == tensors.keys() and all(state[k] is tensors[k] for k in state)  # the same tensors
    net.load_state_dict(_Net().state_dict())  # a plain model's checkpoint loads into the converted one
    saved = net.state_dict()
    assert revert(net) is net
    assert {name: type(m) for name, m in net.named_modules()} == before
    _Net().load_state_dict(saved)  # and the converted one's into a plain model
    assert net.state_dict().keys() == saved.keys()
    assert all(not hasattr(m, batchnorm.ORIGINAL) for m in net.modules())
    assert (
        type(convert(nn.BatchNorm1d(2))) is GlobalBatchNorm
        and type(revert(convert(nn.BatchNorm1d(2)))) is nn.BatchNorm1d
    )


def test_a_lazy_batchnorm_not_yet_initialised_stays_and_is_warned_of(caplog):
    model = nn.Sequential(nn.LazyBatchNorm1d())
    with caplog.at_level(logging.WARNING, logger=batchnorm.__name__):
        assert type(BatchNormSync().apply(model)[0]) is nn.LazyBatchNorm1d
    assert [r.getMessage() for r in caplog.records] == ["lazy BatchNorm modules not yet initialised are not synced: 0"]


def test_revert_gives_back_what_training_changed():
    net = convert(nn.Sequential(nn.BatchNorm1d(3)))
    net(torch.randn(5, 3) + 2)
    net.eval()
    trained = net[0].running_mean.clone()
    net = revert(net)
    assert type(net[0]) is nn.BatchNorm1d and not net[0].training
    assert torch.equal(net[0].running_mean, trained) and int(net[0].num_batches_tracked) == 1


def _cfg(sync, strategy: str = "ddp", devices: int = 2, accelerator: str = "cpu", num_nodes: int = 1) -> dict:
    trainer = {"sync_batchnorm": sync}
    return {
        "trainer": trainer,
        "strategy": {"name": strategy},
        "devices": devices,
        "num_nodes": num_nodes,
        "accelerator": accelerator,
        "cluster": "auto",
    }


def _plugins(cfg, model=None):
    return batchnorm_plugins(cfg, world_of(cfg), model)  # build_trainer's call, with the plan's World


def test_the_plugin_is_on_by_default_under_several_ddp_processes():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    (default,) = _plugins(compose_cfg("strategy=ddp", "devices=2", "accelerator=cpu"), model)
    (on,) = _plugins(_cfg(True, "ddp_spawn", devices=3), model)
    (off,) = _plugins(_cfg(False), model)
    assert isinstance(default, BatchNormSync) and default.sync and on.sync and not off.sync and not default.cuda
    assert on.processes == 3 and _plugins(_cfg("auto", devices=1, num_nodes=2))[0].sync  # model not known
    assert _plugins(_cfg(None, accelerator="gpu"))[0].cuda  # torch's SyncBatchNorm on CUDA
    assert _plugins(_cfg(None, devices=1), model) == []
    assert _plugins(_cfg(True, "auto", devices=1), model) == []
    assert _plugins(_cfg(None, "dp", accelerator="gpu"), nn.Linear(2, 2)) == []  # no BatchNorm under dp
    assert type(default.apply(model)[1]) is GlobalBatchNorm and type(default.revert(model)[1]) is nn.BatchNorm1d


def test_strategy_dp_over_several_devices_with_batchnorm_is_refused_in_one_line():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    with pytest.raises(ConfigError) as err:
        _plugins(_cfg(None, "dp", accelerator="gpu"), model)
    assert str(err.value).startswith("strategy=dp with devices=2 and BatchNorm modules (1): ")
    assert "use strategy=ddp devices=2" in str(err.value) and "\n" not in str(err.value)
    assert _plugins(_cfg(None, "dp", devices=1, accelerator="gpu"), model) == []


@pytest.mark.parametrize("setting", ["trainer.sync_batchnorm=true", "trainer.sync_batchnorm=null"])
def test_the_trainer_gets_the_plugin_and_never_lightnings_cuda_only_one(setting, tmp_path):
    cfg = compose_cfg("strategy=ddp", "devices=2", "accelerator=cpu", "logger=none", setting)
    trainer = build_trainer(cfg, world_of(cfg), tmp_path, model=nn.Sequential(nn.BatchNorm1d(2)))
    layer_sync = trainer.strategy._layer_sync
    assert isinstance(layer_sync, BatchNormSync) and layer_sync.sync and not isinstance(layer_sync, TorchSyncBatchNorm)


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_a_sync_batchnorm_value_other_than_null_true_false_is_refused(value):
    with pytest.raises(ConfigError, match=rf"^trainer.sync_batchnorm={value!r} is invalid: use null"):
        _plugins(_cfg(value))


def test_sync_batchnorm_false_converts_nothing_and_warns_once_naming_the_modules(caplog):
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))
    with caplog.at_level(logging.WARNING, logger=batchnorm.__name__):
        assert BatchNormSync(sync=False, processes=2).apply(model) is model
    assert type(model[1]) is nn.BatchNorm1d
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("trainer.sync_batchnorm=false with 2 processes: 1, 2.0 normalise each process's own")
    assert line.endswith("ddp no longer trains as one process: trainer.sync_batchnorm=null syncs them")
    caplog.clear()
    BatchNormSync(sync=False).apply(nn.Linear(2, 2))
    assert caplog.records == []


# Several gloo processes


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )

    def average(grad: torch.Tensor) -> None:
        torch.distributed.all_reduce(grad)  # the DDP sum; _run_steps divides by the world size

    results = {case: _run_steps(convert(_layer(case)), case, world, rank, average) for case in CASES}
    torch.save(results, out)
    torch.distributed.destroy_process_group()


def _gather(world: int, tmp_path: Path) -> dict[str, dict[str, list[torch.Tensor]]]:
    """Run ``_worker`` in ``world`` forked processes (nothing to import again); return each case's results with
    the chunks concatenated."""
    port, context = free_port(), multiprocessing.get_context("fork")
    procs = [
        context.Process(target=_worker, args=(rank, world, port, str(tmp_path / f"rank{rank}.pt")), daemon=True)
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 90
    try:
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * world
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(world)]
    merged = {}
    for case in CASES:
        parts = [r[case] for r in ranks]
        merged[case] = {
            key: [torch.cat([p[key][i] for p in parts]) for i in range(len(parts[0][key]))]
            for key in ("out", "grad_x", "eval")
        }
        for key in ("grad_w", "grad_b", "running"):  # the same on every rank
            for p in parts[1:]:
                assert all(torch.equal(a, b) for a, b in zip(p[key], parts[0][key], strict=True)), (case, key)
            merged[case][key] = parts[0][key]
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_several_gloo_processes_equal_one_process_on_the_global_batch(world, tmp_path):
    """Outputs, input and parameter gradients (DDP-averaged), running statistics and eval outputs of
    BatchNorm1d/2d/3d over ``world`` processes against one nn.BatchNorm on the concatenated batch; one sample
    per process trains too (nn.BatchNorm1d refuses one sample)."""
    merged = _gather(world, tmp_path)
    for case in CASES:
        diff = _max_diff(merged[case], _one_process_of(case, world))
        assert max(diff.values()) <= TOL, (case, diff)
    # the test can fail: one process's own statistics are not the global batch's
    local = torch.cat([_run_steps(_layer("2d"), "2d", world, rank)["out"][0] for rank in range(world)])
    assert (local - _one_process_of("2d", world)["out"][0]).abs().max() > 1e-2


# train.py end to end

BN_MODEL = '''
from torch import nn

from dpddp.models.mlp import MLPClassifier


class BatchNormMLP(MLPClassifier):
    """The built-in MLP with a BatchNorm1d after its first Linear."""

    def __init__(self, num_features=64, num_classes=10, hidden=(128,), dropout=0.0, optimizer="adam", lr=0.003,
                 momentum=0.9, weight_decay=0.0):
        super().__init__(num_features, num_classes, hidden, dropout, optimizer, lr, momentum, weight_decay)
        self.net.insert(1, nn.BatchNorm1d(self.net[0].out_features))
'''
# SGD: under Adam the bias just before the BatchNorm, whose gradient is 0 but for rounding, moves by the rounding's
# sign (about lr a step on any world size)
E2E = ["model=mlp", "model._target_=bnmlp.BatchNormMLP", "model.hidden=[16]", "model.optimizer=sgd", "model.lr=0.1"]
E2E += ["accelerator=cpu"]
E2E += ["data.num_samples=512", "trainer.max_epochs=2", "trainer.enable_progress_bar=false"]
DDP2 = ["strategy=ddp", "devices=2"]


def _train(cwd: Path, run: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(cwd))
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "train.py"), *E2E, *args, f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _net(run: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("net.")}


@pytest.fixture(scope="module")
def bn_project(tmp_path_factory) -> Path:
    """A user's BatchNorm model (``bnmlp.py``) and its one-process run ``one``, trained in this process (``train``
    on the composed config: what train.py runs)."""
    path = tmp_path_factory.mktemp("bn")
    (path / "bnmlp.py").write_text(BN_MODEL)
    sys.path.insert(0, str(path))
    try:
        train(compose_cfg(*E2E), path / "one")
    finally:
        sys.path.remove(str(path))
        sys.modules.pop("bnmlp", None)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("setting", [[], ["trainer.sync_batchnorm=true"]])
def test_ddp_with_batchnorm_ends_with_the_weights_and_running_stats_of_one_process(bn_project, setting):
    run = "two_" + "_".join(setting).replace(".", "_").replace("=", "_")
    _train(bn_project, run, *DDP2, *setting)
    one, two = _net(bn_project / "one"), _net(bn_project / run)
    assert one.keys() == two.keys() and "net.1.running_var" in one and int(one["net.1.num_batches_tracked"]) > 1
    diff = {k: (one[k] - two[k]).abs().max().item() for k in one}
    assert max(diff.values()) <= TOL, diff


@pytest.mark.slow
def test_ddp_with_sync_batchnorm_false_trains_warns_once_and_differs_from_one_process(bn_project):
    proc = _train(bn_project, "unsynced", *DDP2, "trainer.sync_batchnorm=false")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "trainer.sync_batchnorm=false with" in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and "2 processes: net.1 normalise each process's" in lines[0]
    one, two = _net(bn_project / "one"), _net(bn_project / "unsynced")
    assert max((one[k] - two[k]).abs().max().item() for k in one) > 1e-3


def _eval_without_running_stats(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layer = GlobalBatchNorm(3, track_running_stats=False).eval()
    x = torch.arange(24.0).view(8, 3) ** 1.5
    torch.save(layer(x.chunk(world)[rank]).detach(), out)
    torch.distributed.destroy_process_group()


def test_without_running_statistics_evaluation_normalises_over_the_global_batch_too(tmp_path):
    """``track_running_stats=False``: an eval forward uses batch statistics, taken over every process's share."""
    x = torch.arange(24.0).view(8, 3) ** 1.5
    expected = torch.nn.BatchNorm1d(3, track_running_stats=False).eval()(x).detach()
    assert GlobalBatchNorm(3, track_running_stats=False).eval()(x).allclose(expected)  # one process: torch's own
    port, context = free_port(), multiprocessing.get_context("fork")
    outs = [str(tmp_path / f"{rank}.pt") for rank in range(2)]
    procs = [context.Process(target=_eval_without_running_stats, args=(r, 2, port, outs[r])) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    got = torch.cat([torch.load(out, weights_only=True) for out in outs])
    assert got.allclose(expected, atol=1e-5) and not GlobalBatchNorm(3, track_running_stats=False).eval()(
        x[:4]
    ).allclose(expected[:4], atol=1e-3)  # a share's own statistics would differ

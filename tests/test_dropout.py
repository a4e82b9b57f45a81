"""Per-sample randomness: SampleDropout's masks are a function of the sample (seed, epoch, id, layer, element), the
sampler records each training batch's ids under its position in the epoch, and the callback sets the keys, so one
process, ddp on any world size and a continued run draw the same masks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import QUIET, child_env, compose_cfg, made_once, train_py_here
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dpddp.nn as nn_keys
from dpddp.data.global_batch import GlobalBatchSampler
from dpddp.data.keys import SampleKeyCallback, uses_sample_keys
from dpddp.errors import ConfigError
from dpddp.models.mlp import MLPClassifier
from dpddp.nn import (
    SampleDropout,
    assign_layer_keys,
    clear_sample_keys,
    key64,
    mix64,
    replica_ids,
    sample_generator,
    sample_keys,
    select_sample_row,
)
from dpddp.parallel.dp import DataParallelStrategy
from dpddp.run.training import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_keys():
    clear_sample_keys()
    yield
    clear_sample_keys()


def _layer(p: float = 0.5, key: int = 0) -> SampleDropout:
    layer = SampleDropout(p)
    layer.layer_key = key
    return layer.train()


def _mask(layer: SampleDropout, ids: torch.Tensor, width: int = 37, seed: int = 0, epoch: int = 0) -> torch.Tensor:
    """The layer's output on ones: ``1 / (1 - p)`` where kept, 0 where dropped."""
    with sample_keys(seed, epoch, ids):
        return layer(torch.ones(len(ids), width))


# The hash


def test_mix64_is_splitmix64():
    """splitmix64 seeded with 0 (state += GAMMA, then the finaliser): its published first output."""
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert key64() == 0 and key64(0) == mix64(0x9E3779B97F4A7C15)


def test_mask_follows_the_documented_formula():
    """u = (mix64(key64(seed, epoch, i) + key64(layer, e)) >> 11) / 2**53, kept when u >= p."""
    seed, epoch, layer, p = 3, 5, 2, 0.5
    ids = torch.tensor([0, 7, 123456789])
    out = _mask(_layer(p, layer), ids, width=9, seed=seed, epoch=epoch)
    for j, i in enumerate(ids.tolist()):
        for e in range(9):
            u = (mix64(key64(seed, epoch, i) + key64(layer, e)) >> 11) / 2**53
            assert bool(out[j, e] != 0) == (u >= p), (i, e)


# The mask is the sample's


def test_a_sample_has_its_mask_whatever_its_batch_and_position():
    ids = torch.randperm(500, generator=torch.Generator().manual_seed(1))[:48]
    layer = _layer(0.5)
    whole = _mask(layer, ids)
    for parts in (2, 3):  # the chunks of ranks, or of DataParallel replicas
        chunks = [_mask(layer, chunk) for chunk in torch.tensor_split(ids, parts)]
        assert torch.equal(torch.cat(chunks), whole)
    order = torch.randperm(48, generator=torch.Generator().manual_seed(2))
    assert torch.equal(_mask(layer, ids[order]), whole[order])  # another batch order
    assert torch.equal(_mask(layer, ids[:1]), whole[:1])  # alone


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_is_p_and_kept_values_are_scaled(p):
    out = _mask(_layer(p), torch.arange(400), width=1000)  # 400,000 elements: the rate's sd is <= 0.0008
    dropped = (out == 0).double().mean().item()
    assert abs(dropped - p) < 0.005
    assert torch.all((out == 0) | torch.isclose(out, torch.tensor(1 / (1 - p))))
    per_sample = (out == 0).double().mean(1)  # no sample's mask is degenerate
    assert per_sample.min() > p - 0.07 and per_sample.max() < p + 0.07


def test_different_seeds_epochs_layers_and_samples_draw_different_masks():
    ids = torch.arange(64)
    base = _mask(_layer(0.5), ids) != 0
    others = {
        "seed": _mask(_layer(0.5), ids, seed=1) != 0,
        "epoch": _mask(_layer(0.5), ids, epoch=1) != 0,
        "layer": _mask(_layer(0.5, key=1), ids) != 0,
        "sample": _mask(_layer(0.5), ids + 64) != 0,
    }
    for name, other in others.items():
        agree = (other == base).double().mean().item()
        assert 0.45 < agree < 0.55, name  # independent masks agree on half of the elements at p = 0.5
    rows = base.double()
    assert (rows[1:] != rows[:-1]).any(1).all()  # neighbouring samples differ


def test_the_layers_of_a_model_get_distinct_keys():
    model = nn.Sequential(nn.Linear(4, 4), SampleDropout(0.5), nn.ReLU(), nn.Sequential(SampleDropout(0.5)))
    assert assign_layer_keys(model) == 2
    assert [m.layer_key for m in model.modules() if isinstance(m, SampleDropout)] == [0, 1]


def test_eval_mode_is_the_identity():
    layer = _layer(0.5).eval()
    x = torch.randn(8, 5)
    with sample_keys(0, 0, torch.arange(8)):
        assert torch.equal(layer(x), x)
    assert torch.equal(layer(x), x)


def test_gradient_is_the_mask_scaled():
    layer, ids = _layer(0.3), torch.arange(16)
    x = torch.randn(16, 3, 5, requires_grad=True)
    with sample_keys(0, 0, ids):
        out = layer(x)
    out.sum().backward()
    keep = out.detach() != 0
    assert torch.allclose(out[keep], x[keep] / 0.7)
    assert torch.allclose(x.grad, keep.float() / 0.7)


def test_p_zero_and_one_and_inplace():
    x, ids = torch.randn(6, 4, requires_grad=True), torch.arange(6)
    with sample_keys(0, 0, ids):
        assert torch.equal(_layer(0.0)(x), x)
        zero = _layer(1.0)(x)
        zero.sum().backward()
        assert torch.equal(zero, torch.zeros_like(x)) and torch.equal(x.grad, torch.zeros_like(x))
        y = torch.randn(6, 4)
        inplace = SampleDropout(0.5, inplace=True)
        inplace.layer_key = 0
        expected = _layer(0.5)(y)
        assert torch.equal(inplace(y), expected) and torch.equal(y, expected)


def test_without_keys_it_is_nn_dropout():
    x = torch.randn(32, 20)
    torch.manual_seed(7)
    ours = SampleDropout(0.4)(x)  # no layer key needed either
    torch.manual_seed(7)
    assert torch.equal(ours, nn.Dropout(0.4)(x))
    with sample_keys(0, 0, torch.arange(32)):
        pass
    torch.manual_seed(7)
    assert torch.equal(SampleDropout(0.4)(x), ours)  # cleared: the global RNG again


def test_misuse_is_refused():
    with sample_keys(0, 0, torch.arange(8)):
        with pytest.raises(RuntimeError, match="assign_layer_keys"):
            SampleDropout(0.5)(torch.ones(8, 2))
        with pytest.raises(ValueError, match="8 sample ids"):
            _layer()(torch.ones(5, 2))


def test_steps_of_an_execution_take_their_row():
    ids = torch.arange(3 * 16).view(3, 16)
    layer = _layer(0.5)
    with sample_keys(0, 0, ids):
        with pytest.raises(ValueError, match="select_sample_row"):
            layer(torch.ones(16, 37))
        rows = []
        for i in range(3):
            select_sample_row(i)
            rows.append(layer(torch.ones(16, 37)))
    assert all(torch.equal(rows[i], _mask(layer, ids[i])) for i in range(3))


def test_dataparallel_replicas_take_their_chunk():
    """torch's scatter gives replica j (device_ids[j]) chunk j of ``tensor.chunk(len(device_ids))``; a small
    batch has fewer chunks than devices."""
    ids, devices = torch.arange(10) + 100, (2, 5, 7)
    cuda = [torch.device("cuda", d) for d in devices]
    assert torch.equal(replica_ids(ids, 10, cuda[0], devices), ids)  # unscattered
    assert torch.equal(replica_ids(ids, 4, cuda[0], devices), ids[:4])
    assert torch.equal(replica_ids(ids, 4, cuda[1], devices), ids[4:8])
    assert torch.equal(replica_ids(ids, 2, cuda[2], devices), ids[8:])
    small = ids[:2]  # chunk(3) of 2 rows: two chunks of 1
    assert torch.equal(replica_ids(small, 1, cuda[1], devices), small[1:])
    for rows, device, devs in [(1, cuda[2], devices), (3, cuda[1], devices), (4, torch.device("cpu"), devices)]:
        with pytest.raises(ValueError, match="sample ids"):
            replica_ids(small if rows == 1 else ids, rows, device, devs)
    with pytest.raises(ValueError):
        replica_ids(ids, 4, cuda[1], None)


# Per-sample randomness in a data set


class NoisyPoints(Dataset):
    """The recipe: a data set with per-sample augmentation from ``sample_generator(seed, epoch, index)``; the
    epoch comes from ``set_epoch``."""

    def __init__(self, n: int = 40, seed: int = 0) -> None:
        self.x, self.seed, self.epoch = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 3), seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] + torch.randn(3, generator=sample_generator(self.seed, self.epoch, i))


def test_sample_generator_depends_on_seed_epoch_and_index_only():
    draw = [torch.rand(4, generator=sample_generator(*key)) for key in [(0, 0, 5), (0, 0, 5), (0, 0, 6), (0, 1, 5)]]
    assert torch.equal(draw[0], draw[1])
    assert not torch.equal(draw[0], draw[2]) and not torch.equal(draw[0], draw[3])
    assert sample_generator(1, 0, 5).initial_seed() != sample_generator(0, 0, 5).initial_seed()


def test_augmentation_recipe_is_the_same_on_every_world_size():
    ds = NoisyPoints()
    ds.set_epoch(3)
    one = {int(i): ds[int(i)] for i in torch.randperm(40)}
    for world_size in (1, 2, 4):
        for rank in range(world_size):
            sampler = GlobalBatchSampler(40, 8, rank, world_size, train=True, seed=0)
            sampler.set_epoch(3)
            for idx in sampler:
                for i in idx.tolist():
                    assert torch.equal(ds[i], one[i])
    ds.set_epoch(4)
    assert not torch.equal(ds[0], one[0])


# The sampler's record and the callback


def _straight(sampler_args: dict, epoch: int) -> list[torch.Tensor]:
    sampler = GlobalBatchSampler(**sampler_args)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("skip", [0, 5, 6])
def test_sampler_records_each_items_ids_under_its_batch_idx(steps, skip):
    """Lightning fetches one batch ahead and, resumed mid-epoch, counts ``batch_idx`` from the batches already
    done (executions with ``steps_per_execution``: a cut one is redone from its rest, at the same index)."""
    args = dict(num_samples=205, batch_size=8, rank=1, world_size=2, train=True, seed=3, steps_per_execution=steps)
    whole = _straight(args, epoch=2)  # 25 global batches
    sampler = GlobalBatchSampler(**args)
    sampler.position = lambda: (2, skip)
    items = iter(sampler)
    ahead = next(items)
    first = skip // steps
    for batch_idx in range(first, len(whole)):
        current, ahead = ahead, next(items, None)  # the next batch is fetched before this one runs
        epoch, ids = sampler.ids_at(batch_idx)
        assert epoch == 2 and ids is current
        if batch_idx == first and steps > 1:  # the rest of the execution the checkpoint cut
            assert torch.equal(ids, whole[first][skip % steps :])
        else:
            assert torch.equal(ids, whole[batch_idx])
        assert sampler.ids_at(batch_idx) is not None  # asked again (a second callback): still there
        assert len(sampler._yielded) <= 2
    assert ahead is None


def test_sampler_record_is_bounded_and_cleared_each_epoch():
    sampler = GlobalBatchSampler(600, 2, train=True)
    sampler.recorded = 50
    assert len(list(sampler)) == 300 and len(sampler._yielded) == 50
    assert sampler.ids_at(10) is None and sampler.ids_at(299) is not None
    sampler.set_epoch(1)
    next(iter(sampler))
    assert list(sampler._yielded) == [0] and sampler.ids_at(0)[0] == 1
    evaluation = GlobalBatchSampler(600, 2)
    list(evaluation)
    assert evaluation._yielded == {}


class _Ids(Dataset):
    """Batches are the id tensors themselves."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return idx.clone()


@pytest.mark.parametrize("workers", [0, 2])
def test_callback_sets_each_batchs_keys_with_loader_workers(workers):
    sampler = GlobalBatchSampler(96, 8, rank=0, world_size=2, train=True, seed=11)
    sampler.position = lambda: (4, 3)
    loader = DataLoader(_Ids(), sampler=sampler, batch_size=None, num_workers=workers)
    trainer = SimpleNamespace(train_dataloader=loader, strategy=None, current_epoch=4)
    model = MLPClassifier(num_features=4, num_classes=2, hidden=[8], dropout=0.5)
    callback = SampleKeyCallback()
    callback.on_train_start(trainer, model)
    assert model.net[2].layer_key == 0 and callback.devices is None
    batches = iter(loader)
    ahead = next(batches)
    for batch_idx in range(3, 12):
        batch, ahead = ahead, next(batches, None)
        callback.on_train_batch_start(trainer, model, batch, batch_idx)
        keys = nn_keys._current[0]
        assert keys is not None and (keys.seed, keys.epoch) == (11, 4) and torch.equal(keys.ids, batch)
        callback.on_train_batch_end(trainer, model, None, batch, batch_idx)
        assert nn_keys._current[0] is None
    with pytest.raises(RuntimeError, match="no sample ids recorded for training batch 2"):
        callback.on_train_batch_start(trainer, model, None, 2)


def test_callback_passes_dataparallel_devices_and_is_only_for_models_that_need_it():
    strategy = DataParallelStrategy()
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    loader = DataLoader(_Ids(), sampler=GlobalBatchSampler(96, 8, train=True), batch_size=None)
    trainer = SimpleNamespace(train_dataloader=loader, strategy=strategy, current_epoch=0)
    callback = SampleKeyCallback()
    callback.on_train_start(trainer, MLPClassifier(dropout=0.5))
    assert callback.devices == [0, 1]
    assert not uses_sample_keys(MLPClassifier()) and uses_sample_keys(MLPClassifier(dropout=0.1))


def test_callback_refuses_data_served_by_no_sampler_of_dpddps():
    trainer = SimpleNamespace(train_dataloader=DataLoader(list(range(8)), batch_size=4), strategy=None)
    with pytest.raises(ConfigError, match=r"^model: MLPClassifier's SampleDropout .* has no sample keys") as err:
        SampleKeyCallback().on_train_start(trainer, MLPClassifier(dropout=0.5))
    assert str(err.value).endswith("data=sharded +data.module._target_=..., or use nn.Dropout")


# End to end: python train.py (needs the run to add the callback: dpddp.run.assembly adds SampleKeyCallback)

MLP = ["model=mlp", "model.dropout=0.5", "accelerator=cpu", "logger=none", "data.num_samples=1000"]
MLP += ["trainer.max_epochs=2"]


def _run(cwd: Path, run: str, *args: str) -> Path:
    env, _ = child_env()
    cmd = [sys.executable, str(ROOT / "train.py"), *args, *QUIET, f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return cwd / run


def _here(cwd: Path, run: str, *args: str) -> Path:
    """``_run``'s one-process run trained in this process (``train`` on the composed config: what train.py runs)."""
    train(compose_cfg(*args, *QUIET), cwd / run)
    return cwd / run


def _py_here(monkeypatch, cwd: Path, run: str, *args: str) -> Path:
    """``_run``'s one-process run through train.py's calls in this process (``resume=true`` is the entry's)."""
    assert train_py_here(*args, f"hydra.run.dir={run}", cwd=cwd, monkeypatch=monkeypatch) == 0
    return cwd / run


def _net(run: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {k: v for k, v in state["state_dict"].items() if k.startswith("net.")} | {"step": state["global_step"]}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a.pop("step") == b.pop("step")
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture
def mlp_one(shared_dir) -> dict[str, torch.Tensor]:
    """The one-process MLP run's weights, run once a session."""
    return _net(made_once(shared_dir, "dropout_mlp_one", lambda path: _here(path.parent, path.name, *MLP)))


@pytest.mark.slow
def test_mlp_dropout_ddp_and_dp_equal_one_process(tmp_path, mlp_one):
    one = mlp_one
    no_dropout = _net(_here(tmp_path, "p0", *MLP, "model.dropout=0"))  # no dropout layer: net.2 is the output
    assert (one["net.0.weight"] - no_dropout["net.0.weight"]).abs().max() > 1e-3  # the dropout is on
    assert _diff(dict(one), _net(_run(tmp_path, "ddp", *MLP, "strategy=ddp", "devices=2"))) <= 1e-5
    assert _diff(dict(one), _net(_here(tmp_path, "dp", *MLP, "strategy=dp", "devices=1"))) <= 1e-6


@pytest.mark.slow
def test_digits_ddp_with_loader_workers_equals_one_process(tmp_path):
    digits = ["data=digits", *[a for a in MLP if not a.startswith("data.")]]
    one = _net(_here(tmp_path, "one", *digits))
    ddp = _net(_run(tmp_path, "ddp", *digits, "strategy=ddp", "devices=2", "+data.num_workers=1"))
    assert _diff(one, ddp) <= 1e-5


@pytest.mark.slow
def test_a_run_continued_mid_epoch_equals_a_straight_one(tmp_path, mlp_one, monkeypatch):
    """12 steps an epoch: stopped at step 7 (mid-epoch) and continued to the end of epoch 2, on 1 and on 2
    processes, against the shared straight run."""
    straight = mlp_one
    first = _py_here(monkeypatch, tmp_path, "a", *MLP, "trainer.max_steps=7")
    shutil.copytree(first, tmp_path / "b")  # one stop, two continues
    assert _diff(dict(straight), _net(_py_here(monkeypatch, tmp_path, "a", *MLP, "resume=true"))) <= 1e-6
    assert _diff(straight, _net(_run(tmp_path, "b", *MLP, "resume=true", "strategy=ddp", "devices=2"))) <= 1e-5


@pytest.mark.slow
def test_steps_per_execution_draws_the_masks_of_single_steps(tmp_path, mlp_one, monkeypatch):
    """K=4 equals K=1, also on 2 processes and stopped inside an execution (step 6) and continued."""
    k1 = mlp_one
    assert _diff(dict(k1), _net(_here(tmp_path, "k4", *MLP, "steps_per_execution=4"))) <= 1e-6
    ddp = ["strategy=ddp", "devices=2", "steps_per_execution=4"]
    assert _diff(dict(k1), _net(_run(tmp_path, "k4ddp", *MLP, *ddp))) <= 1e-5
    _py_here(monkeypatch, tmp_path, "cut", *MLP, "steps_per_execution=4", "trainer.max_steps=6")
    resumed = _py_here(monkeypatch, tmp_path, "cut", *MLP, "steps_per_execution=4", "resume=true")
    assert _diff(k1, _net(resumed)) <= 1e-6


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_masks_on_cuda_equal_masks_on_cpu():
    ids = torch.randperm(5000)[:300]
    layer = _layer(0.3, key=4)
    with sample_keys(2, 9, ids):
        cpu = layer(torch.ones(300, 70, 3))
        cuda = layer(torch.ones(300, 70, 3, device="cuda"))
    assert torch.equal(cuda.cpu(), cpu)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dp_over_all_gpus_with_dropout_equals_one_gpu(tmp_path):
    """Each DataParallel replica takes its chunk of the batch's ids (``replica_ids``)."""
    gpu = [a.replace("accelerator=cpu", "accelerator=gpu") for a in MLP]
    one = _net(_run(tmp_path, "one", *gpu))
    dp = _net(_run(tmp_path, "dp", *gpu, "strategy=dp", f"devices={torch.cuda.device_count()}"))
    assert _diff(one, dp) <= 1e-5

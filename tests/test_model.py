import importlib
import inspect
import pkgutil

import pytest
import torch

import dpddp
from dpddp.models.linear import LinearClassifier


def test_forward_shapes_and_empty_batch():
    model = LinearClassifier(num_features=5, num_classes=3)
    assert model(torch.randn(7, 5)).shape == (7, 3)
    # an empty evaluation chunk (last global batch smaller than the world size) adds nothing to the metrics
    model._eval_step((torch.randn(0, 5), torch.zeros(0, dtype=torch.long)), "val")
    model._eval_step((torch.randn(2, 5), torch.tensor([0, 1])), "val")
    assert model.val_loss.weight.item() == 2


def test_optimizers():
    assert isinstance(LinearClassifier(optimizer="adam").configure_optimizers(), torch.optim.Adam)
    sgd = LinearClassifier(lr=0.3, momentum=0.5).configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.5 and sgd.defaults["lr"] == 0.3


def test_no_removed_step_end_hooks_anywhere():
    """Lightning 2.0 removed *_step_end; a module defining one would silently never be called."""
    modules = [importlib.import_module(m.name) for m in pkgutil.walk_packages(dpddp.__path__, "dpddp.")]
    classes = {
        c for m in modules for _, c in inspect.getmembers(m, inspect.isclass) if c.__module__.startswith("dpddp")
    }
    assert len(classes) > 10
    offenders = [
        f"{obj.__qualname__}.{attr}"
        for obj in classes
        for attr in vars(obj)
        if attr.endswith("_step_end") or attr.endswith("_epoch_end") and attr.startswith(("training_", "validation_"))
    ]
    assert offenders == []


def test_train_loss_is_the_mean_over_every_sample_of_the_epoch():
    """The running sum taken per step and handed to the metric once per epoch weighs steps by their samples."""
    torch.manual_seed(0)
    model = LinearClassifier(num_features=5, num_classes=3)
    batches = [(torch.randn(n, 5), torch.randint(0, 3, (n,))) for n in (4, 1, 7)]
    for i, batch in enumerate(batches):
        model.training_step(batch, i)
    model.log_dict = lambda *args, **kwargs: None  # no trainer here: check the metric itself
    model.on_train_epoch_end()
    x, y = (torch.cat(t) for t in zip(*batches, strict=True))
    expected = torch.nn.functional.cross_entropy(model(x), y)
    assert model.train_loss.compute().item() == pytest.approx(expected.item(), rel=1e-6)
    assert model._train_samples == 12  # kept for a checkpoint after the epoch's end (a limit's stop)
    model.on_train_epoch_start()
    assert model._train_samples == 0 and model._train_loss_sum is None  # reset as the next epoch starts

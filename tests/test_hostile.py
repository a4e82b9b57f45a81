"""Property-based: any value for any public key is either accepted, or refused with one line naming the key."""

import difflib
import math

import pytest
from conftest import compose_cfg
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import GrammarParseError

from dpddp.errors import ConfigError
from dpddp.run.assembly import build_trainer
from dpddp.run.config import check_config
from dpddp.run.keys import TRAINER_OWNED, allowed_keys

BASE = compose_cfg("accelerator=cpu")
junk = st.one_of(st.text(max_size=12), st.lists(st.integers(), max_size=2), st.just(None), st.booleans())
big = st.integers(min_value=10**12, max_value=10**30)
nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])

# key -> (values that must be refused, values that must be accepted with every other setting at its default)
KEYS = {
    "devices": (
        st.one_of(st.integers(max_value=0).filter(lambda v: v != -1), big, st.floats(0.1, 0.9), junk),
        st.just(1),
    ),
    "num_nodes": (st.one_of(st.integers(max_value=0), st.floats(1.1, 9), junk), st.just(1)),
    "seed": (
        st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32), st.floats(0.1, 9.9), junk),
        st.integers(0, 2**32 - 1),
    ),
    "data.num_samples": (
        st.one_of(st.integers(max_value=0), big, st.floats(1.5, 9.5), junk),
        st.integers(500, 100_000),
    ),
    "data.num_features": (st.one_of(st.integers(max_value=0), big, junk), st.integers(1, 64)),
    "data.num_classes": (st.one_of(st.integers(max_value=1), big, junk), st.integers(2, 16)),
    "data.batch_size": (st.one_of(st.integers(max_value=0), big, st.floats(1.5, 9.5), junk), st.integers(1, 256)),
    "data.val_fraction": (st.one_of(st.floats(-9, -0.01), st.floats(0.91, 9), nonfinite, junk), st.floats(0.01, 0.4)),
    "data.label_noise": (st.one_of(st.floats(-9, -0.01), st.floats(1.01, 9), nonfinite, junk), st.floats(0, 1)),
    "model.lr": (st.one_of(st.floats(-9, 0), st.floats(1e4, 1e30), nonfinite, junk), st.floats(1e-6, 10)),
    "model.momentum": (st.one_of(st.floats(-9, -0.01), st.floats(1, 9), nonfinite, junk), st.floats(0, 0.99)),
    "model.weight_decay": (st.one_of(st.floats(-9, -0.01), nonfinite, junk), st.floats(0, 1)),
    "model.optimizer": (
        st.text(max_size=12).filter(lambda v: v not in ("sgd", "adam")),
        st.sampled_from(["sgd", "adam"]),
    ),
    "accelerator": (st.text(max_size=12).filter(lambda v: v not in ("auto", "cpu", "gpu", "cuda")), st.just("cpu")),
    "strategy.name": (
        st.text(max_size=12).filter(lambda v: v not in ("auto", "dp", "ddp", "ddp_spawn")),
        st.sampled_from(["auto", "dp"]),
    ),
    "cluster": (st.text(max_size=12).filter(lambda v: v not in ("auto", "kubeflow")), st.just("auto")),
    "trainer.max_epochs": (  # None is Lightning's default (1000 epochs): valid
        st.one_of(st.integers(max_value=-2), st.just(0), st.floats(1.5, 9.5), st.text(max_size=5)),
        st.integers(1, 10**6),
    ),
    "trainer.precision": (
        st.text(max_size=12).filter(lambda v: v.strip() not in ("", "32", "64", "16", "bf16")),
        st.sampled_from(["32-true", "bf16-mixed", "64-true"]),
    ),
    "ckpt_path": (st.text(min_size=1, max_size=20).filter(lambda v: v.strip() and "\x00" not in v), st.just(None)),
}


def _with(key, value):
    cfg = BASE.copy()
    node, _, leaf = key.rpartition(".")
    with open_dict(cfg):
        try:
            (cfg[node] if node else cfg)[leaf] = value
        except GrammarParseError:  # a broken interpolation ("${"): no config can hold it, Hydra refuses it first
            assume(False)
    return cfg


# The keys whose value the Trainer takes: only these build one (the others' values reach no Trainer argument).
TRAINER_KEYS = {"devices", "num_nodes", "accelerator", "strategy.name", "trainer.max_epochs", "trainer.precision"}


def _validate(cfg, tmp_path_factory, key):
    """``check_config``, then (a key the Trainer takes) ``build_trainer`` of ``cfg``; returns where each key's value
    shows."""
    world = check_config(cfg).world
    if key not in TRAINER_KEYS:
        return lambda k: OmegaConf.select(cfg, k)
    trainer = build_trainer(cfg, world, tmp_path_factory.mktemp("run"))
    seen = {"devices": trainer.num_devices, "num_nodes": trainer.num_nodes, "accelerator": world.accelerator}
    seen.update({"strategy.name": world.strategy, "trainer.max_epochs": trainer.max_epochs})
    seen.update({"trainer.precision": str(trainer.precision)})
    return lambda k: seen[k]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), key=st.sampled_from(sorted(KEYS)))
def test_bad_values_are_refused_naming_the_key(tmp_path_factory, data, key):
    value = data.draw(KEYS[key][0], label=key)
    try:
        _validate(_with(key, value), tmp_path_factory, key)
    except ConfigError as err:
        message = str(err)
        named = "strategy" if key == "strategy.name" else key.rpartition(".")[2]  # users set the group: strategy=
        assert "\n" not in message and named in message, message
    else:
        raise AssertionError(f"{key}={value!r} was accepted")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), key=st.sampled_from(sorted(KEYS)))
def test_good_values_are_accepted(tmp_path_factory, data, key):
    """The run takes the value: the Trainer's flag, the world's, or the checked config's (left as given)."""
    value = data.draw(KEYS[key][1], label=key)
    assert _validate(_with(key, value), tmp_path_factory, key)(key) == value


LOGGERS = "logger=csv|tensorboard|mlflow|wandb|none"
ALL_OF = "valid keys: _target_, lr, momentum, num_classes, num_features, optimizer, weight_decay"


def _refusal(section, name):
    with pytest.raises(ConfigError) as err:
        check_config(_with(f"{section}.{name}" if section else name, 1))
    return str(err.value)


@pytest.mark.parametrize(
    "section,name,line",
    [
        ("", "devises", "unknown setting devises: did you mean devices?"),
        ("trainer", "max_epoch", "unknown setting trainer.max_epoch: did you mean trainer.max_epochs?"),
        ("data", "batchsize", "unknown setting data.batchsize: did you mean data.batch_size?"),
        ("model", "learning_rate", f"unknown setting model.learning_rate: {ALL_OF}"),
        ("strategy", "backend", "unknown setting strategy.backend: did you mean strategy.process_group_backend?"),
        ("trainer", "logger", "trainer.logger is not set in the trainer group: choose a logger group: " + LOGGERS),
    ],
)
def test_an_unknown_key_is_one_line_with_the_closest_valid_key(section, name, line):
    assert _refusal(section, name) == line


@settings(max_examples=100, deadline=None)
@given(
    section=st.sampled_from(["", "data", "model", "trainer", "strategy"]),
    name=st.from_regex(r"[a-z_]{1,15}", fullmatch=True),
)
def test_unknown_keys_are_refused_with_a_suggestion(section, name):
    """Any unknown key of any section: ``unknown setting <key>: did you mean <the closest valid key>?`` (difflib's
    similarity, at least 0.5), else the line lists every valid key of the section; a Trainer argument the trainer
    group must not set: its own line and fix."""
    allowed = allowed_keys()[section]
    if name in allowed:
        return
    message, prefix = _refusal(section, name), f"{section}." if section else ""
    if section == "trainer" and name in TRAINER_OWNED:
        assert message == f"trainer.{name} is not set in the trainer group: {TRAINER_OWNED[name]}"
        return
    similarity = {key: difflib.SequenceMatcher(None, key, name).ratio() for key in allowed}
    best = max(similarity.values())
    if best < 0.5:
        assert message == f"unknown setting {prefix}{name}: valid keys: {', '.join(sorted(allowed))}"
        return
    head = f"unknown setting {prefix}{name}: did you mean {prefix}"
    assert message.startswith(head) and message.endswith("?"), message
    assert similarity.get(message[len(head) : -1]) == best, message  # the closest (any of equally close ones)

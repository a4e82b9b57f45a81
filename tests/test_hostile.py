"""Property-based: any value for any public key is either accepted, or refused with one line naming the key."""

import math

from conftest import compose_cfg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import open_dict

from dpddp.errors import ConfigError
from dpddp.run.config import allowed_keys, check_config
from dpddp.run.trainer import build_trainer

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
        (cfg[node] if node else cfg)[leaf] = value
    return cfg


def _validate(cfg, tmp_path_factory):
    check_config(cfg)
    build_trainer(cfg, tmp_path_factory.mktemp("run"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), key=st.sampled_from(sorted(KEYS)))
def test_bad_values_are_refused_naming_the_key(tmp_path_factory, data, key):
    value = data.draw(KEYS[key][0], label=key)
    try:
        _validate(_with(key, value), tmp_path_factory)
    except ConfigError as err:
        message = str(err)
        named = "strategy" if key == "strategy.name" else key.rpartition(".")[2]  # users set the group: strategy=
        assert "\n" not in message and named in message, message
    else:
        raise AssertionError(f"{key}={value!r} was accepted")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), key=st.sampled_from(sorted(KEYS)))
def test_good_values_are_accepted(tmp_path_factory, data, key):
    _validate(_with(key, data.draw(KEYS[key][1], label=key)), tmp_path_factory)


@settings(max_examples=100, deadline=None)
@given(
    section=st.sampled_from(["", "data", "model", "trainer", "strategy"]),
    name=st.from_regex(r"[a-z_]{1,15}", fullmatch=True),
)
def test_unknown_keys_are_refused_with_a_suggestion(section, name):
    if name in allowed_keys()[section]:
        return
    try:
        check_config(_with(f"{section}.{name}" if section else name, 1))
    except ConfigError as err:
        assert f"unknown setting {section + '.' if section else ''}{name}" in str(err) or "trainer." in str(err)
    else:
        raise AssertionError(f"{section}.{name} was accepted")

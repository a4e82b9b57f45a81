"""Per-sample randomness, the same on every world size and across a resume: ``SampleDropout`` keeps element ``e``
of sample ``i`` in layer ``L`` when ``(mix64(key64(seed, epoch, i) + key64(L, e)) >> 11) / 2**53 >= p`` (splitmix64's
``mix64``); in a data set, ``sample_generator(seed, epoch, index)``."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

_U64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:  # value mod 2**64 as the int64 of the same bits
    value &= _U64
    return value - (1 << 64) if value >> 63 else value


def mix64(z: int) -> int:
    """splitmix64's finaliser on ``z`` mod ``2**64``: a bijection, result in ``[0, 2**64)``."""
    z &= _U64
    z = ((z ^ (z >> 30)) * _M1) & _U64
    z = ((z ^ (z >> 27)) * _M2) & _U64
    return z ^ (z >> 31)


def key64(*values: int) -> int:
    """The 64-bit key of integers of any sign: ``h -> mix64(h + (v + 1) * GAMMA)`` for each ``v``, from 0."""
    h = 0
    for v in values:
        h = mix64(h + (v + 1) * GAMMA)
    return h


_S1, _S2, _SG = _signed(_M1), _signed(_M2), _signed(GAMMA)
_LOW = {s: (1 << (64 - s)) - 1 for s in (11, 27, 30, 31)}  # logical shift by s: arithmetic shift, then this mask


def _mix_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``mix64`` in place on int64 ``z`` (uint64 bits); ``tmp``: scratch of ``z``'s shape."""
    for shift, mult in ((30, _S1), (27, _S2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        z.bitwise_xor_(tmp.bitwise_and_(_LOW[shift]))
        if mult is not None:
            z.mul_(mult)
    return z


def _fold(h: int, values: torch.Tensor) -> torch.Tensor:
    """``mix64(h + (v + 1) * GAMMA)`` for each int64 ``v`` of ``values`` (a new tensor, on their device)."""
    z = values.to(torch.int64) * _SG + _signed(h + GAMMA)
    return _mix_(z, torch.empty_like(z))


def sample_states(seed: int, epoch: int, ids: torch.Tensor) -> torch.Tensor:
    """``key64(seed, epoch, i)`` for each id ``i`` of ``ids`` (int64, the bits of the uint64 keys)."""
    return _fold(key64(seed, epoch), ids)


_BLOCK = 1 << 16  # elements hashed at a time on CPU: the int64 scratch stays in cache


def _keep_mask(states: torch.Tensor, elements: torch.Tensor, p: float) -> torch.Tensor:
    """bool ``[len(states), len(elements)]``: element ``e`` of sample ``j`` kept (CPU: ``_BLOCK`` at a time)."""
    device, n, numel = states.device, len(states), len(elements)
    keep = torch.empty(n, numel, dtype=torch.bool, device=device)
    rows = max(1, _BLOCK // max(numel, 1)) if device.type == "cpu" else max(n, 1)
    z_block = torch.empty(min(rows, n) * numel, dtype=torch.int64, device=device)
    tmp_block = torch.empty_like(z_block)
    threshold = math.ceil(p * 2.0**53)  # u >= p exactly: p * 2**53 is exact in a float
    for start in range(0, n, rows):
        size = min(rows, n - start)
        z, tmp = z_block[: size * numel].view(size, numel), tmp_block[: size * numel].view(size, numel)
        torch.add(states[start : start + size, None], elements, out=z)
        _mix_(z, tmp)
        torch.bitwise_right_shift(z, 11, out=tmp)
        torch.ge(tmp.bitwise_and_(_LOW[11]), threshold, out=keep[start : start + size])
    return keep


def replica_ids(ids: torch.Tensor, rows: int, device: torch.device, devices: Sequence[int] | None) -> torch.Tensor:
    """The ids of ``rows`` samples on ``device``: ``ids``, or under ``DataParallel`` over CUDA ``devices`` the
    chunk torch's scatter gives ``device``. Raises ValueError: no chunk of ``rows`` ids belongs to ``device``."""
    if len(ids) == rows:
        return ids
    if devices and device.type == "cuda" and device.index in devices:
        position, chunks = list(devices).index(device.index), ids.chunk(len(devices))
        if position < len(chunks) and len(chunks[position]) == rows:
            return chunks[position]
    raise ValueError(
        f"SampleDropout got {rows} samples on {device} but the training batch has {len(ids)} sample ids "
        f"(DataParallel devices: {list(devices) if devices else None}): the layer's input must have the samples "
        "along dim 0"
    )


@dataclass
class SampleKeys:
    """One training batch's keys: ``ids`` ``[b]`` or ``[k, b]`` (``row``: the step), ``part``: a micro-batch's."""

    seed: int
    epoch: int
    ids: torch.Tensor
    devices: tuple[int, ...] | None = None
    row: int | None = None
    part: tuple[int, int] | None = None
    _states: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    def states_for(self, x: torch.Tensor) -> torch.Tensor:
        """``sample_states`` of ``x``'s samples (dim 0) on its device, cached. Raises ValueError: ``[k, b]`` ids
        and no valid row, or no ids of ``x``'s length (``replica_ids``)."""
        key = (self.row, self.part, x.device, x.shape[0])
        if key in self._states:
            return self._states[key]
        ids = self.ids
        if ids.dim() == 2:
            if self.row is None or not 0 <= self.row < len(ids):
                raise ValueError(
                    f"the training batch has ids of shape {list(ids.shape)} (several steps) and step {self.row} is "
                    "selected: call dpddp.nn.select_sample_row(i) before step i"
                )
            ids = ids[self.row]
        ids = replica_ids(ids if self.part is None else ids[slice(*self.part)], x.shape[0], x.device, self.devices)
        self._states[key] = sample_states(self.seed, self.epoch, ids.to(x.device))
        return self._states[key]


_current: list[SampleKeys | None] = [None]  # one slot per process: DataParallel's replica threads read it too


def set_sample_keys(seed: int, epoch: int, ids: torch.Tensor, devices: Sequence[int] | None = None) -> SampleKeys:
    """Make ``(seed, epoch, ids)`` the keys of the training batch now running; returns them."""
    keys = SampleKeys(int(seed), int(epoch), ids, tuple(devices) if devices else None)
    _current[0] = keys
    return keys


def clear_sample_keys() -> None:
    """No keys: ``SampleDropout`` behaves as ``nn.Dropout`` again."""
    _current[0] = None


def select_sample_row(row: int) -> None:
    """Step ``row`` of an execution: the layers take row ``row`` of ``[k, b]`` ids (no-op without keys)."""
    if _current[0] is not None:
        _current[0].row = row


def select_sample_part(part: tuple[int, int] | None) -> None:
    """A micro-batch: the layers take the step's ids ``[start, stop)`` (``None``: all; no-op without keys)."""
    if _current[0] is not None:
        _current[0].part = part


@contextmanager
def sample_keys(seed: int, epoch: int, ids: torch.Tensor, devices: Sequence[int] | None = None) -> Iterator[SampleKeys]:
    try:
        yield set_sample_keys(seed, epoch, ids, devices)
    finally:
        clear_sample_keys()


def assign_layer_keys(model: nn.Module) -> int:
    """Key each ``SampleDropout`` of ``model`` by its place in ``model.modules()``; returns their number."""
    layers = [m for m in model.modules() if isinstance(m, SampleDropout)]
    for index, layer in enumerate(layers):
        layer.layer_key = index
    return len(layers)


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``key64(seed, epoch, index)`` (augmentation in a data set)."""
    return torch.Generator().manual_seed(key64(seed, epoch, index))


class SampleDropout(nn.Dropout):
    """``nn.Dropout``, keyed (samples along dim 0) when keys are set in training. Raises ValueError: ``p`` outside
    ``[0, 1]``, keys and a 0-dim input or samples not the ids; RuntimeError: keys and no ``assign_layer_keys``."""

    layer_key: int | None = None

    def _elements(self, layer: int, numel: int, device: torch.device) -> torch.Tensor:
        """``key64(layer, e)`` for ``e < numel`` on ``device``, built once a shape (kept on the layer)."""
        built = self.__dict__.setdefault("_element_keys", {})
        key = (layer, numel, device)
        if key not in built:
            built[key] = _fold(key64(layer), torch.arange(numel, dtype=torch.int64, device=device))
        return built[key]

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        keys = _current[0]
        if not self.training or keys is None:
            return F.dropout(input, self.p, self.training, self.inplace)
        if self.layer_key is None:
            raise RuntimeError(
                "SampleDropout has no layer key while sample keys are set: call dpddp.nn.assign_layer_keys(model)"
            )
        if input.dim() == 0:
            raise ValueError("SampleDropout needs samples along dim 0, got a 0-dim input")
        states = keys.states_for(input)
        if self.p == 1:  # as torch's dropout: zeros and a zero gradient (not 0 * inf)
            zero = torch.zeros((), dtype=input.dtype, device=input.device)
            return input.mul_(zero) if self.inplace else input * zero
        elements = self._elements(self.layer_key, math.prod(input.shape[1:]), input.device)
        keep = _keep_mask(states, elements, self.p).view(input.shape)
        scale = 1 / (1 - self.p)
        if self.inplace:
            return input.mul_(scale).masked_fill_(~keep, 0)
        return torch.where(keep, input * scale, 0)

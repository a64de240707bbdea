"""HostTensors without a coordinator: refusing non-finite deltas before anything is sent; what travels."""

from __future__ import annotations

import pytest
import torch

from lightning_nodeox.core.codec import NonFiniteDeltaError
from lightning_nodeox.core.codecs.settings import CodecSettings, Q4Settings
from lightning_nodeox.core.wire import MessageMeta
from lightning_nodeox.host.tensors import HostTensors, shared_tensors


def exchange_for(model: torch.nn.Module, settings: CodecSettings = Q4Settings()) -> HostTensors:
    tensors = HostTensors(shared_tensors(model))
    tensors.allocate(settings, codec_threads=1)
    return tensors


def encode(tensors: HostTensors, samples: int):
    return tensors.encode(tensors.live, MessageMeta("delta", 0, "h", "", samples=samples), seed=None).join()


def test_nan_delta_is_refused_naming_the_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ex = exchange_for(model)
    with torch.no_grad():
        model[1].running_var[1] = float("nan")
    with pytest.raises(NonFiniteDeltaError, match=r"parameter '1.running_var' in round 0 holds NaN or Inf"):
        encode(ex, 8)
    ex.close()


def test_delta_beyond_fp16_scales_names_the_fix() -> None:
    model = torch.nn.Linear(4, 3)
    ex = exchange_for(model)
    with torch.no_grad():
        model.weight[0, 0] += 1e6
    with pytest.raises(NonFiniteDeltaError, match=r"'weight' .* too large for fp16 scales; .*--scale-dtype fp32"):
        encode(ex, 8)
    ex.close()
    fp32 = exchange_for(model := torch.nn.Linear(4, 3), Q4Settings(scale_dtype="fp32"))
    with torch.no_grad():
        model.weight[0, 0] += 1e6
    message = encode(fp32, 8)
    assert message.meta.samples == 8 and bool(torch.isfinite(message.scales(0)).all())
    fp32.close()


def test_shared_tensors_take_parameters_and_buffers_once_integer_ones_included() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    model[2].weight = model[0].weight  # tied
    names = [n for n, _ in shared_tensors(model)]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                     "1.num_batches_tracked", "2.bias"]
    assert HostTensors(shared_tensors(model)).raw_names == ["1.num_batches_tracked"]


class _Body:
    """A sync's bytes as a :class:`~lightning_nodeox.core.protocol.ByteStream`."""

    def __init__(self, data: bytes) -> None:
        self.size, self._data = len(data), data

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), len(self._data))
        view[:n], self._data = self._data[:n], self._data[n:]
        return n

    def close(self) -> None:
        pass


def test_the_sync_buffer_grows_to_the_largest_sync_and_a_smaller_one_reuses_it() -> None:
    backbone, head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)
    backbone.requires_grad_(False)  # frozen at join: the first buffer is a head's sync
    tensors = HostTensors.of_module(torch.nn.Sequential(backbone, head))
    tensors.allocate(Q4Settings(), codec_threads=1)
    head_size = tensors.part.layout.total
    assert head_size < tensors.layout.total
    total = tensors.layout.total
    whole = tensors.receive(_Body(bytes(range(256)) * (total // 256) + b"x" * (total % 256)))
    assert whole.numel() == total and whole[:256].tolist() == list(range(256))
    small = tensors.receive(_Body(b"\x07" * head_size))  # the backbone frozen again: no new buffer
    assert small.numel() == head_size and small.data_ptr() == whole.data_ptr() and bool((small == 7).all())
    tensors.close()

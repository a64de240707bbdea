"""A host's message buffers (host/staging.py): on the CPU the codec works in the message itself; the sync buffer
is reused, grows to the largest sync, and a smaller sync takes its start."""

from __future__ import annotations

import pytest
import torch

from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of
from lightning_nodeox.core.wire import Message, MessageLayout
from lightning_nodeox.host.staging import Staging, as_bytes

SPECS = spec_of([("w", torch.zeros(300)), ("n", torch.zeros(2, dtype=torch.int64))])
LAYOUT = MessageLayout.of(SPECS, Q4Settings())


def test_on_the_cpu_the_codec_works_in_the_message() -> None:
    staging = Staging(torch.device("cpu"), LAYOUT, 64)
    assert staging.delta is None and staging.sync is None
    message = Message.allocate(LAYOUT)
    codes, scales = staging.region(message, 0, staging.delta)
    assert codes.data_ptr() == message.codes(0).data_ptr() and scales.data_ptr() == message.scales(0).data_ptr()
    staging.unstage_delta(message, LAYOUT.pieces[0])  # nothing to copy
    staging.fit(message)


def test_a_staging_area_holds_a_tensors_codes_and_scales_where_the_message_does() -> None:
    staging = Staging(torch.device("cpu"), LAYOUT, 64)
    area = torch.zeros(LAYOUT.total - LAYOUT.data_start, dtype=torch.uint8)
    message = Message.allocate(LAYOUT)
    codes, scales = staging.region(message, 0, area)
    (ca, _), (sa, _) = LAYOUT.regions[0].codes, LAYOUT.regions[0].scales
    assert codes.untyped_storage().data_ptr() == area.data_ptr() and scales.dtype == LAYOUT.codec.scale_dtype
    assert scales.numel() == message.scales(0).numel() and scales.data_ptr() == area[sa:].data_ptr()


def test_the_sync_buffer_grows_to_the_largest_sync_and_a_smaller_one_takes_its_start() -> None:
    staging = Staging(torch.device("cpu"), LAYOUT, 64)
    first = staging.sync_buffer(64)
    assert staging.sync_buffer(32).data_ptr() == first.data_ptr()
    big = staging.sync_buffer(1000)
    assert big.numel() == 1000 and staging.sync_buffer(10).data_ptr() == big.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_a_tensors_bytes_are_a_flat_view(dtype) -> None:
    t = torch.ones(3, 2, dtype=dtype)
    view = as_bytes(t)
    assert view.dtype == torch.uint8 and view.numel() == t.numel() * t.element_size()
    assert view.data_ptr() == t.data_ptr()

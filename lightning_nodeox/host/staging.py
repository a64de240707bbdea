"""Where a host's messages are read and written: the reused sync buffer (pinned on a GPU) and, on a device other
than the CPU, device staging areas where the codec works (only packed bytes cross to host memory): a delta's and a
sync's, since a sync is applied while the delta is still encoded.

Memory: two staging areas of one message on a GPU (a sparse sync's grows once per sync, :meth:`Staging.fit`).
"""

from __future__ import annotations

import torch

from ..core.wire import Message, MessageLayout, Piece


class Staging:
    """The buffers of a host's messages on ``device`` (``layout``: the whole model's, ``sync_size``: the bytes of
    the first sync buffer)."""

    def __init__(self, device: torch.device, layout: MessageLayout, sync_size: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.scale_dtype = layout.codec.scale_dtype
        self._sync_buffer = torch.empty(sync_size, dtype=torch.uint8, pin_memory=self.cuda)
        self.delta: torch.Tensor | None = None
        self.sync: torch.Tensor | None = None
        if device.type != "cpu":
            self.delta = torch.empty(layout.total - layout.data_start, dtype=torch.uint8, device=device)
            self.sync = torch.empty_like(self.delta)

    def region(self, message: Message, j: int, staging: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the codec reads and writes the codes and scales of the message's tensor ``j``: the message
        itself, or ``staging`` (:attr:`delta` or :attr:`sync`) on a device."""
        if staging is None:
            return message.codes(j), message.scales(j)
        region = message.layout.regions[j]
        (ca, cb), (sa, sb) = region.codes, region.scales
        return message.layout.codes_of(j, staging[ca:cb]), staging[sa:sb].view(self.scale_dtype)

    def unstage_delta(self, message: Message, piece: Piece) -> None:
        """A delta's piece, encoded in device staging, into its message (waiting for the copy)."""
        if self.delta is None:
            return
        a, b = piece.data
        message.data[a:b].copy_(self.delta[a:b], non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def fit(self, sync: Message) -> None:
        """Room for ``sync`` in the sync's staging (a sparse sync outgrows the delta's)."""
        if self.sync is not None and self.sync.numel() < sync.layout.trailer:
            self.sync = torch.empty(sync.layout.trailer, dtype=torch.uint8, device=self.device)

    def stage_sync(self, sync: Message, piece: Piece) -> None:
        """A sync's piece, as it arrived, into the sync's staging."""
        if self.sync is not None:
            a, b = piece.data
            self.sync[a:b].copy_(sync.data[a:b])

    def sync_buffer(self, size: int) -> torch.Tensor:
        """The buffer a sync of ``size`` bytes is read into: the reused one (it grows to the largest sync, and a
        sync of fewer tensors takes its start)."""
        if self._sync_buffer.numel() < size:
            self._sync_buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
        return self._sync_buffer[:size]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.view(-1).view(torch.uint8)

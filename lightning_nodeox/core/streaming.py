"""A message read as its sender makes it: the upload of a delta starts with its header while its first piece is
still being encoded, and each piece goes on the wire once sealed (:mod:`lightning_nodeox.core.wire`).

:class:`MessageReader` is file-like (``read``, ``__len__``, ``rewind``), which is what an HTTP client needs for a
body with a Content-Length; :meth:`MessageReader.produce` runs the sender's work on a thread of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .wire import Message


class MessageReader:
    """Reads ``message`` (its header written) up to what its sender has sealed so far; ``read`` waits for more,
    and raises the sender's error if it failed (the upload is then cut: its receiver keeps what it checked)."""

    def __init__(self, message: Message, *, timeout: float = 600.0) -> None:
        self.message = message
        self._view = message.view()
        self._ready = message.layout.data_start  # bytes readable: the header, then each sealed piece
        self._pos = 0
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.timeout = timeout
        self.done_at = 0.0  # when the message was made (Unix seconds)
        self.record: object | None = None  # what its maker times it with (a host: its encode phase)

    @classmethod
    def whole(cls, message: Message) -> MessageReader:
        """A reader of a message made already."""
        reader = cls(message)
        reader.finished()
        return reader

    def __len__(self) -> int:
        return len(self._view)

    def rewind(self) -> None:
        """Start over (before a retried upload): the pieces sealed are sent again, then the rest as it comes."""
        self._pos = 0

    def sealed(self, k: int) -> None:
        """Piece ``k`` is sealed: its bytes may go."""
        with self._changed:
            self._ready = max(self._ready, self.message.wire_end(k))
            self._changed.notify_all()

    def finished(self) -> None:
        """The trailer is written: the whole message may go."""
        with self._changed:
            self._ready = len(self._view)
            self.done_at = time.time()
            self._changed.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._changed:
            self._error = error
            self._changed.notify_all()

    @property
    def complete(self) -> bool:
        return self._ready == len(self._view)

    def read(self, n: int = -1) -> memoryview | bytes:
        if self._pos >= len(self._view):
            return b""
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready > self._pos or self._error is not None, self.timeout):
                raise TimeoutError(f"the message's next piece was not made within {self.timeout:.0f} s")
            if self._error is not None and self._ready <= self._pos:
                raise self._error
            end = self._ready if n is None or n < 0 else min(self._ready, self._pos + n)
        chunk, self._pos = self._view[self._pos : end], end
        return chunk

    def produce(self, make: Callable[[int], None], finish: Callable[[], None],
                after: Callable[[], None] | None = None) -> None:
        """Run ``make(k)`` for each piece (sealing it), then ``finish()`` (writing the trailer), then ``after()``
        whatever happened, on a thread of their own; :meth:`join` waits for it."""
        def run() -> None:
            try:
                for k in range(len(self.message.layout.pieces)):
                    make(k)
                    self.sealed(k)
                finish()
                self.finished()
            except BaseException as e:  # noqa: BLE001 - handed to the reader and to join()
                self.failed(e)
            finally:
                if after is not None:
                    after()

        self._thread = threading.Thread(target=run, name="nodeox-encode", daemon=True)
        self._thread.start()

    def join(self) -> Message:
        """The message once made; raises the sender's error if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.message

"""TensorBoard event files on a disk that fails (full, unwritable): the logs never stop what they log.

TensorBoard writes an event file from a thread of its own; a write that fails ends that thread, and every later
call of its writer raises the error again (a Lightning ``TensorBoardLogger`` turns it into an error that ends
``fit``). :class:`RetryingEventWriter` stands in for such a writer: a failure is said through a
:class:`~lightning_nodeox.core.trouble.Trouble` (once, then every minute, and when writing works again), the dead
writer is closed, and ``RETRY_S`` seconds later a new one (a new event file in the same folder) takes the events;
those in between are lost, and counted.

The dying thread's own traceback says nothing its writer's caller is not told: :func:`quiet_writer_threads` keeps
it off stderr through ``threading.excepthook`` (any other thread's exception goes to the hook it found).

Checked against tensorboard 2.21 (``EventFileWriter``: ``add_event``, ``flush``, ``close``, ``get_logdir``; its
thread ``_AsyncWriterThread`` re-raises what it dies on) and torch 2.14 (a ``SummaryWriter``'s ``FileWriter``
writes through its ``event_writer``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tensorboard.summary.writer.event_file_writer import EventFileWriter, _AsyncWriterThread

from .trouble import Trouble


class RetryingEventWriter:
    """An ``EventFileWriter`` whose disk failures (``OSError``) never reach its caller. ``make``: a new writer
    (a new event file in ``logdir``); ``writer``: the one to start with (else one is made at the first event)."""

    RETRY_S = 10.0  # how soon a writer that failed is made again

    def __init__(self, logdir: str, make: Callable[[], EventFileWriter], trouble: Trouble,
                 writer: EventFileWriter | None = None) -> None:
        self.logdir = logdir
        self._make = make
        self.trouble = trouble
        self._writer = writer
        self._retry_at = 0.0
        self._error: OSError | None = None

    def get_logdir(self) -> str:
        return self.logdir

    def add_event(self, event: Any) -> None:
        self._use(lambda writer: writer.add_event(event), lost=1)

    def flush(self) -> None:
        self._use(lambda writer: writer.flush(), lost=0)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError as e:
                self.trouble.failed(e)

    def _use(self, call: Callable[[EventFileWriter], None], lost: int) -> None:
        writer = self._live()
        if writer is None:
            self.trouble.failed(self._error, lost)
            return
        try:
            call(writer)
        except OSError as e:
            self._drop(e, lost)
            return
        self.trouble.ok()

    def _live(self) -> EventFileWriter | None:
        """The writer, made again once ``RETRY_S`` has passed since the last failure (its first event written and
        flushed: it fails at once on a disk still full)."""
        if self._writer is None and time.monotonic() >= self._retry_at:
            quiet_writer_threads()
            try:
                self._writer = self._make()
            except OSError as e:
                self._drop(e, 0)
        return self._writer

    def _drop(self, error: OSError, lost: int) -> None:
        self._error = error
        self.trouble.failed(error, lost)
        self._retry_at = time.monotonic() + self.RETRY_S
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:  # a dead writer raises its error again while closing
                pass


class QuietWriterThreads:
    """A ``threading.excepthook`` that drops the ``OSError`` a TensorBoard writer thread dies on (its writer raises
    it to the caller) and hands every other exception to ``previous``."""

    def __init__(self, previous: Callable[[Any], object]) -> None:
        self.previous = previous

    def __call__(self, args: Any) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
            return
        self.previous(args)


def quiet_writer_threads() -> None:
    """Install :class:`QuietWriterThreads` in front of the current ``threading.excepthook`` (once)."""
    if not isinstance(threading.excepthook, QuietWriterThreads):
        threading.excepthook = QuietWriterThreads(threading.excepthook)

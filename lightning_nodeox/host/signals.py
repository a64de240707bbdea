"""Preemption: on SIGTERM a host leaves the run promptly and exits non-zero.

Lightning notes a SIGTERM and raises ``SIGTERMException`` at the end of the batch. A host waiting on the
coordinator (at a round boundary, or in its final round) never gets there, so this handler, chained after
Lightning's while training runs, makes the host's pending requests give up and, when the training thread is
waiting on the exchange, raises ``SIGTERMException`` there at once. The strategy's ``on_exception`` then leaves
the run, and :func:`exit_code_for` makes the process exit with 128 + SIGTERM (Lightning's exception alone
exits 0, which looks like success to ``nodeox launch`` and to schedulers).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future

from lightning.pytorch.utilities.exceptions import SIGTERMException


class SigtermHandler:
    """Chained before the SIGTERM handler in place (Lightning's) between :meth:`install` and :meth:`uninstall`."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel
        self.received = False
        self._waiting = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and self._previous is None:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self)

    def uninstall(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def __call__(self, signum: int, frame) -> None:
        self.received = True
        self.cancel()
        if callable(self._previous):
            self._previous(signum, frame)
        if self._waiting:
            raise SIGTERMException()

    def wait(self, future: Future):
        """``future.result()``, given up at once on SIGTERM."""
        if self.received:
            raise SIGTERMException()
        self._waiting = True
        try:
            return future.result()
        finally:
            self._waiting = False


def exit_code_for(exception: BaseException) -> None:
    """Make a ``SIGTERMException`` exit the process with 128 + SIGTERM, as a process killed by it would."""
    if isinstance(exception, SIGTERMException) and not exception.code:
        exception.code = 128 + signal.SIGTERM

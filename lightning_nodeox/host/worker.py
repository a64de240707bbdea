"""The host's exchange worker: runs rounds on a thread of their own, so the round boundary only hands over."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class ExchangeWorker:
    """One thread; ``submit`` returns a future that the training side waits on when (and only when) it must."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nodeox-exchange")

    def submit(self, fn: Callable, *args) -> Future:
        return self._executor.submit(fn, *args)

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)

"""WorkerPool: runs chunked tensor work (codec kernels, hashing) on the threads this process is granted.

On the CPU every worker runs ATen single-threaded (so an op never enters an OpenMP region, whose barriers
collapse when the CPU is oversubscribed) and tasks are shared out dynamically, so a worker that loses its
core delays only its own task. On a GPU tasks run inline on the caller's stream. Each worker thread has its
own :class:`~lightning_nodeox.core.codecs.Kernels` scratch, of the run's codec.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from .codecs import codec_for
from .codecs.base import CPU_CHUNK_SINGLE_THREADED, CUDA_CHUNK, Kernels
from .codecs.settings import CodecSettings

TASK_ELEMENTS = 1 << 20  # work unit handed to one worker
Task = Callable[[Kernels], None]
RangeWork = Callable[[Kernels, int, int, int], None]  # (kernels, tensor index, start, stop)


def _single_threaded_worker() -> None:
    torch.get_num_threads()  # let ATen initialise this thread's setting first, then pin it to one thread
    torch.set_num_threads(1)


class WorkerPool:
    """``threads`` workers (CPU) or the caller's stream (GPU), each with its own kernels for ``settings``."""

    def __init__(self, settings: CodecSettings, device: torch.device | str = "cpu", threads: int = 1) -> None:
        self.settings = settings
        self.codec = codec_for(settings)
        self.device = torch.device(device)
        self._local = threading.local()
        self._executor: ThreadPoolExecutor | None = None
        if self.device.type != "cpu":
            self.threads, self.chunk = 1, CUDA_CHUNK
            return
        self.threads, self.chunk = max(1, threads), max(CPU_CHUNK_SINGLE_THREADED, self.codec.alignment)
        process_threads = torch.get_num_threads()
        started = threading.Barrier(self.threads)
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="nodeox-worker",
                                            initializer=_single_threaded_worker)
        for f in [self._executor.submit(started.wait) for _ in range(self.threads)]:  # start every worker now
            f.result()
        torch.set_num_threads(process_threads)  # the workers' setting also became the default for new threads

    def kernels(self) -> Kernels:
        k = getattr(self._local, "kernels", None)
        if k is None:
            k = self._local.kernels = self.codec.kernels(self.device, self.chunk)
        return k

    def run(self, tasks: Sequence[Task]) -> None:
        """Run every task; the first error is raised once all of them have stopped touching their buffers."""
        if self._executor is None:
            for task in tasks:
                task(self.kernels())
            return
        futures = [self._executor.submit(lambda t=task: t(self.kernels())) for task in tasks]
        wait(futures)
        for future in futures:
            future.result()

    def split(self, numel: int) -> list[tuple[int, int]]:
        """Flat ranges of about TASK_ELEMENTS values, aligned to the chunk size."""
        step = max(self.chunk, TASK_ELEMENTS // self.chunk * self.chunk)
        return [(s, min(numel, s + step)) for s in range(0, numel, step)]

    def over_ranges(self, sizes: Sequence[int], work: RangeWork) -> None:
        """``work(kernels, i, start, stop)`` over every task-sized range of every tensor ``i`` of ``sizes``."""
        self.over(range(len(sizes)), sizes.__getitem__, work)

    def over(self, indices: Sequence[int], size: Callable[[int], int], work: RangeWork) -> None:
        """``work(kernels, i, start, stop)`` over every task-sized range of each tensor ``i`` of ``indices`` (some of
        a message's: a piece), of ``size(i)`` values."""
        self.run([lambda k, i=i, a=a, b=b: work(k, i, a, b) for i in indices for a, b in self.split(size(i))])

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

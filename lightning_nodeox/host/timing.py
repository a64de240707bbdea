"""When a host's round closes: after ``local_steps`` optimizer steps, or with ``round_seconds`` at the first step
after a time budget.

Steps are counted as Lightning's ``trainer.global_step`` (and ``max_steps``) counts them: every optimizer step is
one, so a manual-optimization batch that steps a generator and a discriminator is two, and with
``accumulate_grad_batches=k`` a step takes k batches. A round closes only where a batch ends, never between two
optimizers of one batch: at the first batch end with at least ``local_steps`` steps since the round began (with
two steps a batch and an odd ``local_steps``, a round holds one step more). Lightning's ``training_step`` and
``optimizer_step`` nest (automatic optimization runs the training step inside the optimizer's closure, manual
optimization steps inside the training step), so a batch ends when the outermost of them returns.

With ``round_seconds``, a round that waited for its sync starts a budget of its own; overlapped rounds keep to a
fixed schedule (boundaries ``round_seconds`` apart), so time lost at a boundary or to a step that overran is made
up and the hosts' boundaries do not drift apart.

Durations and deadlines are measured on a monotonic clock, so a step of the wall clock (NTP, a suspended VM)
neither stalls a round nor closes it early; only :attr:`RoundTiming.start`, the training record's timestamp, is
wall-clock time (phase records are mapped onto the coordinator's clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class RoundTiming:
    """The current round's steps, samples and start, and whether it is due to close."""

    def __init__(self, local_steps: int, round_seconds: float | None, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.local_steps = local_steps
        self.round_seconds = round_seconds
        self.clock = clock  # monotonic: what durations and deadlines are measured on
        self.wall = wall
        self.steps = 0
        self.samples = 0
        self.start = 0.0  # wall-clock time the current round started (for its training record)
        self.deadline = 0.0  # with round_seconds: when the current round closes, on ``clock``
        self._depth = 0
        self._stepped = 0  # optimizer steps of the batch now running

    @contextmanager
    def inside(self) -> Iterator[None]:
        """Around a (possibly nested) ``training_step`` or ``optimizer_step``."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def stepped(self) -> None:
        """An optimizer stepped in the batch now running (each call is one step, as in ``trainer.global_step``)."""
        self._stepped += 1

    def add_samples(self, samples: int) -> None:
        self.samples += samples

    def batch_ended(self) -> bool:
        """Whether a batch that stepped just ended (outside every nested step); its steps are then counted, once."""
        if self._depth or not self._stepped:
            return False
        self.steps += self._stepped
        self._stepped = 0
        return True

    def due(self) -> bool:
        if self.round_seconds is not None:
            return self.clock() >= self.deadline
        return self.steps >= self.local_steps

    def begin(self, *, overlapped: bool = False) -> None:
        """A round starts now (``overlapped``: the last one closed without waiting for its sync)."""
        self.steps = self.samples = 0
        self.start = self.wall()
        budget = self.round_seconds
        if budget is None:
            return
        now = self.clock()
        self.deadline = self.deadline + budget if overlapped else now + budget
        if self.deadline <= now:  # behind by a whole round: start afresh
            self.deadline = now + budget

"""When a host's training ends, and what the run does then (stopping together).

A host whose ``fit`` ends (``max_steps``, ``max_epochs``, ``trainer.should_stop`` from EarlyStopping or any
callback) sends its final delta; the coordinator makes that round the run's last one, and its sync completes
the run. A host still training learns it when it applies that sync at its next round boundary, and stops
there (``trainer.should_stop``). So every host ends after the same round, on the same model.

A round boundary that falls on a host's last batch is that host's final round (no empty extra round); with a
weight-averaging callback it closes in ``on_train_end``, after the callbacks' (:mod:`lightning_nodeox.host.agreement`).
"""

from __future__ import annotations

from lightning.pytorch import Trainer


def steps_taken(trainer: Trainer) -> int:
    """``trainer.global_step``, counting an optimizer step in progress (Lightning counts it once it returns)."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        return loop.automatic_optimization.optim_progress.optimizer.step.total.ready
    return loop.manual_optimization.optim_step_progress.total.ready


def ends_after_this_batch(trainer: Trainer) -> bool:
    """Whether Lightning ends ``fit`` after the batch now stepping."""
    loop = trainer.fit_loop
    steps = steps_taken(trainer)
    if loop.max_steps not in (None, -1) and steps >= loop.max_steps:
        return True
    if trainer.should_stop and loop._can_stop_early:
        return True
    batches = loop.epoch_loop.batch_progress
    last_batch = batches.is_last_batch or batches.current.ready == trainer.num_training_batches
    last_epoch = loop.max_epochs not in (None, -1) and loop.epoch_progress.current.processed + 1 >= loop.max_epochs
    return last_batch and last_epoch

"""A host's TensorBoard loggers on a disk that fails (full, unwritable): training goes on (the model matters more
than its logs). Each ``TensorBoardLogger`` of the Trainer writes through a
:class:`~lightning_nodeox.core.eventfiles.RetryingEventWriter`: the failure is one line (then one a minute, and one
when writing works again), the events logged meanwhile are lost and counted, and a new event file in the
logger's folder takes them once the disk has room. Without this, the writer's error ends ``fit``."""

from __future__ import annotations

from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from lightning.pytorch.loggers import Logger
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from torch.utils.tensorboard import SummaryWriter

from ..core.eventfiles import RetryingEventWriter
from ..core.trouble import Trouble


def keep_writing_through_disk_failures(loggers: list[Logger], name: str) -> None:
    """Give every TensorBoard logger of this rank (a host's rank 0 writes) a retrying event writer, once.
    ``name``: what its lines start with."""
    for logger in loggers:
        if not isinstance(logger, TensorBoardLogger):
            continue
        writer = logger.experiment  # made on rank zero; elsewhere a stand-in that writes nothing
        if not isinstance(writer, SummaryWriter):
            continue
        file_writer = writer._get_file_writer()  # Lightning's log_hyperparams uses it too (torch 2.14)
        if isinstance(file_writer.event_writer, RetryingEventWriter):
            continue
        logdir = file_writer.get_logdir()
        file_writer.event_writer = RetryingEventWriter(
            logdir, lambda w=writer, d=logdir: EventFileWriter(d, w.max_queue, w.flush_secs, w.filename_suffix),
            Trouble(f"TensorBoard events in {logdir}", name), file_writer.event_writer)

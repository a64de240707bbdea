"""Where a host writes, and its place on its machine.

- One run folder: under ``nodeox launch`` (which sets ``NODEOX_RUN_DIR``), a Trainer given no folder of its own
  writes into ``RUN_DIR/hosts/host<id>/``: that becomes its ``default_root_dir``, and its default logger
  (TensorBoard, or CSV without tensorboard) writes versions there, beside the run's phases. Hosts then never
  write into the same folder (LightningCLI's config file included). Under Fabric, ``fabric.save``/``load`` of a
  relative path go there too (:func:`own_path`).
- Loggers kept apart: any other TensorBoardLogger or CSVLogger whose version was not given (one you pass,
  ``CSVLogger("logs")``, or the default one outside ``nodeox launch``) logs into its own sub-folder ``host<id>``
  of its experiment's folder (``logs/lightning_logs/host<id>/version_<n>/``), so hosts that share a folder never
  race for a version (:func:`keep_loggers_apart`).
- Local rank: ``NODEOX_LOCAL_HOST_RANK`` (``nodeox launch`` sets it: the host's position among the hosts it
  started on this machine) is the strategy's ``local_rank``, so Lightning calls ``prepare_data`` on one host
  per machine; the other hosts of the machine wait for it at Lightning's ``pre_setup`` barrier (a marker file
  in the run folder). Without the variable every host is local rank 0 and prepares its own data.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..core.settings import ENV_LOCAL_RANK, ENV_RUN_DIR, ENV_URL

log = logging.getLogger(__name__)

PREPARED = ".prepare_data-done"  # in RUN_DIR/hosts/: holds the coordinator URL of the launch that prepared
PREPARE_TIMEOUT = 3600.0


def local_rank() -> int:
    value = os.environ.get(ENV_LOCAL_RANK, "0")
    if not value.isdigit():
        raise ValueError(f"{ENV_LOCAL_RANK}={value!r} must be a non-negative integer (nodeox launch sets it)")
    return int(value)


def folder_name(host_id: str) -> str:
    """``host<id>``, with the characters a file name cannot hold replaced."""
    return "host" + re.sub(r"[^A-Za-z0-9_.-]", "_", host_id)


def host_folder(run_dir: str | Path, host_id: str) -> Path:
    return Path(run_dir) / "hosts" / folder_name(host_id)


def own_path(path: str | Path, host_id: str) -> Path:
    """Where a host's own file goes: under ``nodeox launch`` a relative ``path`` is taken inside the host's run
    folder (hosts of one machine share a working directory); else, and an absolute path, as given."""
    run_dir = os.environ.get(ENV_RUN_DIR)
    path = Path(path)
    return host_folder(run_dir, host_id) / path if run_dir and not path.is_absolute() else path


def use_run_folder(trainer: Trainer, host_id: str) -> Path | None:
    """Point a Trainer that was given no folder at ``RUN_DIR/hosts/host<id>`` (when ``NODEOX_RUN_DIR`` is set)."""
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir or os.path.abspath(trainer.default_root_dir) != os.getcwd():
        return None
    folder = host_folder(run_dir, host_id)
    trainer._default_root_dir = str(folder)  # Lightning has no setter; read through trainer.default_root_dir
    loggers = trainer.loggers
    if len(loggers) == 1 and _is_default_logger(loggers[0]):
        trainer.logger = type(loggers[0])(save_dir=str(folder.parent), name=folder.name)
    return folder


def keep_loggers_apart(trainer: Trainer, host_id: str) -> None:
    """Give each TensorBoardLogger and CSVLogger whose version was not given (and that has not begun writing) its
    own sub-folder ``host<id>`` of its experiment's folder, unless it writes in this host's own folder already (the
    run folder's default logger)."""
    own = folder_name(host_id)
    for logger in trainer.loggers:
        if (isinstance(logger, (TensorBoardLogger, CSVLogger)) and logger._version is None
                and logger._experiment is None and Path(logger.root_dir).name != own):
            logger._name = os.path.join(logger.name or "", own)  # the loggers have no setter; root_dir reads it


def _is_default_logger(logger) -> bool:
    """The logger Lightning makes for ``logger=True``: TensorBoard (or CSV), ``lightning_logs`` in the cwd."""
    return (type(logger) in (TensorBoardLogger, CSVLogger) and logger.name == "lightning_logs"
            and os.path.abspath(logger.save_dir) == os.getcwd() and logger._version is None)


def after_prepare_data(trainer: Trainer, rank: int) -> None:
    """At Lightning's ``pre_setup`` barrier: local rank 0 says its ``prepare_data`` is done; the other hosts of the
    machine wait until it has (only when the module or datamodule has a ``prepare_data``)."""
    run_dir, url = os.environ.get(ENV_RUN_DIR), os.environ.get(ENV_URL, "")
    prepares = is_overridden("prepare_data", trainer.lightning_module) or (
        trainer.datamodule is not None and is_overridden("prepare_data", trainer.datamodule))
    if not run_dir or not prepares:
        return
    marker = Path(run_dir) / "hosts" / PREPARED
    if rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(url)
        return
    deadline = time.monotonic() + PREPARE_TIMEOUT
    while not (marker.exists() and marker.read_text() == url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the host with {ENV_LOCAL_RANK}=0 on this machine did not finish prepare_data "
                               f"within {PREPARE_TIMEOUT:.0f} s (no {marker}); see its output")
        time.sleep(0.2)

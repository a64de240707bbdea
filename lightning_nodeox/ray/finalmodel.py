"""The run's final model as the coordinator saved it when the run completed (``RUN_DIR/state/``: ``run.json`` and
the snapshot it names), read on the coordinator's machine and handed to the driver: every exchanged tensor by name,
the round it ends, and its hash, checked against the one the coordinator published."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..coordinator.state import RunStore
from ..core.hashing import model_hash


@dataclass(frozen=True)
class FinalModel:
    """The model a completed run ended with: the hosts hold the same bytes (``model_hash`` is theirs too).
    ``round``: the rounds the run published (0 to round - 1); this model is the one the last of them made."""

    round: int
    model_hash: str
    tensors: dict[str, torch.Tensor]

    @classmethod
    def read(cls, run_dir: Path) -> FinalModel:
        """The snapshot the coordinator of ``run_dir`` saved at the run's end; a ``ValueError`` says what is
        missing or does not match."""
        store = RunStore(Path(run_dir))
        saved = store.load()
        if saved is None or not saved.complete:
            raise ValueError(f"{run_dir} holds no completed run (state/run.json)")
        read = store.read_tensors(saved, "model")
        if read is None or saved.snapshot_hash != saved.model_hash:
            raise ValueError(f"{run_dir}/state holds no snapshot of the final model (hash {saved.model_hash})")
        specs, tensors = read
        named = [(spec.name, t.clone()) for spec, t in zip(specs, tensors)]
        digest = model_hash(named)
        if digest != saved.model_hash:
            raise ValueError(f"{run_dir}/state: the snapshot hashes {digest}, run.json says {saved.model_hash}")
        return cls(saved.round, digest, dict(named))

"""A coordinator's start on its run's object store (``--store``), before any host can join: the store is checked,
the run's lease taken (:mod:`~lightning_nodeox.coordinator.lease`), then the run's state taken up from the store
when the run directory holds none (:mod:`~lightning_nodeox.coordinator.statecopy`), or the store's copy removed
with ``--fresh``. Each refusal is a ValueError naming the fix (the coordinator exits with status 2)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..core.stores import StoreError, open_store
from .config import CoordinatorConfig
from .lease import Lease, LeaseKeeper
from .state import RUN_FILE, STATE_DIR
from .statecopy import PREFIX, StateCopy


@dataclass
class Claim:
    """What a coordinator holds in its run's store: the lease (renewed by ``keeper``) and the state's copy."""

    keeper: LeaseKeeper
    copy: StateCopy

    def release(self) -> None:
        """Write nothing more to the store, and give the lease back if it is still ours."""
        self.copy.stop()
        self.keeper.release()


def claim_store(config: CoordinatorConfig) -> Claim:
    """Check the store, take the lease, and take the run's state up from the store (or remove it: ``--fresh``)."""
    store = open_store(config.store)
    try:
        store.check()
    except StoreError as e:
        raise ValueError(str(e)) from None
    lease = Lease(store, config.store_lease)
    keeper = LeaseKeeper(lease, config.name)
    state_dir = Path(config.run_dir) / STATE_DIR
    copy = StateCopy(store, state_dir, config.name)
    try:
        lease.acquire()
        if config.fresh:
            if removed := copy.clear():
                print(f"{config.name}: --fresh: removed the earlier run's state from {store.url} ({removed} objects)",
                      flush=True)
        elif not (state_dir / RUN_FILE).exists():
            round_ = copy.fetch()
            if round_ is not None:
                print(f"{config.name}: the run was taken up from the store {store.url} at round {round_} (its state "
                      f"is now in {state_dir})", flush=True)
        else:
            _not_behind(store, state_dir, config)
    except StoreError as e:
        keeper.release()
        raise ValueError(f"--store {store.url}: {e}") from None
    except BaseException:
        keeper.release()
        raise
    return Claim(keeper, copy)


def _not_behind(store, state_dir: Path, config: CoordinatorConfig) -> None:
    """Refuse a run directory whose state is older than the store's: another coordinator went on with the run,
    and resuming here would take it back (and overwrite the store's copy)."""
    try:
        theirs = int(json.loads(store.get(PREFIX + RUN_FILE))["round"])
        ours = int(json.loads((state_dir / RUN_FILE).read_text())["round"])
    except (StoreError, OSError, ValueError, KeyError, TypeError):
        return  # nothing to compare: the store holds no state, or run.json is refused when it is read
    if theirs > ours:
        raise ValueError(f"{store.url} holds the run's state at round {theirs}, later than {state_dir} (round {ours}): "
                         "another coordinator went on with the run. Move that folder aside to take the run up from "
                         "the store, or start with --fresh to begin a new run")

"""The run's state copied to its object store (``--store``) as ``state/<name>``, so that a coordinator on another
machine takes the run up from an empty run directory.

Copying: each file :class:`~lightning_nodeox.coordinator.state.RunStore` writes into ``state/`` is put to the store
after it is written here, on the save's thread (never the event loop); ``run.json`` only once every file it names
is in the store (those an earlier copy missed are put first), so the store's ``run.json`` names only files already
there. The outer state written ahead of a publish is copied with the save after it (the publish does not wait for
the store). Files removed here are deleted from the store once its ``run.json`` no longer names them. A store that
fails never fails nor holds back the save here: it is said once (then every minute, and when it works again) and
the copy catches up at the next save; what the store holds is tracked by name and CRC-32.

Taking up: :meth:`StateCopy.fetch` downloads the store's ``run.json`` and the files it names (with the next round's
sync and outer state, which a save cut short leaves) into ``state/``; the run then resumes as from its own run
directory (a damaged file is refused naming ``--fresh``). :meth:`StateCopy.clear` removes the copy (``--fresh``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

from ..core.files import write_atomic
from ..core.stores import Store, StoreError, StoreMissing
from ..core.trouble import Trouble
from .state import RUN_FILE, STATE_DIR

PREFIX = f"{STATE_DIR}/"
CHUNK = 8 << 20
LINK = ".link"  # state/<name>.link: the file is the payload objects it lists, end to end (no second upload)
LINK_WAIT = 120.0  # seconds a save waits for the payload upload of the same bytes before uploading them itself


class StateCopy:
    """The copy of ``state_dir`` in ``store`` under ``state/``; ``name``: what its lines start with."""

    def __init__(self, store: Store, state_dir: Path, name: str) -> None:
        self.store = store
        self.dir = Path(state_dir)
        self.trouble = Trouble(f"the copy of the run's state in {store.url}", name, counts=False,
                               meanwhile="the run goes on, its state saved on this machine; the copy catches up at "
                                         "the next save")
        self.stopped = False  # the run is another coordinator's now: nothing is written any more
        self._held: dict[str, int] | None = None  # name -> CRC-32 of what the store holds (None: not listed yet)
        self._written: dict[str, int] = {}  # name -> CRC-32 of the file written here by this process
        self._stale: set[str] = set()  # removed here, still in the store
        self._current = False  # whether the store's run.json is the one written here last
        # the payload objects holding a state file's bytes already (coordinator/payloads.py), or None
        self.linker: Callable[[str, int, float], list[str] | None] | None = None
        self._linked: set[str] = set()  # names this process holds in the store as links

    # -- copying -----------------------------------------------------------------------------------------------
    def wrote(self, name: str, crc: int, names: Collection[str] = (), *, copy: bool = True) -> None:
        """``state/<name>`` was written here (CRC-32 ``crc``): put it to the store, after the files it names
        (``names``: run.json's); ``copy`` False: only noted, copied with the next ``run.json`` that names it."""
        self._written[name] = crc
        self._stale.discard(name)
        if name == RUN_FILE:
            self._current = False
        if not copy or self.stopped:
            return
        try:
            self._list()
            for other in names:
                self._copy(other)
            self._copy(name)
            if name == RUN_FILE:
                self._current = True
                self._prune()
        except (StoreError, OSError) as e:
            self.trouble.failed(e)
            return
        self.trouble.ok()

    def removed(self, names: Iterable[str]) -> None:
        """Files removed from ``state/``: deleted from the store once its run.json no longer names them."""
        for name in names:
            self._written.pop(name, None)
            self._stale.add(name)
        if self.stopped or not self._current:
            return
        try:
            self._prune()
        except (StoreError, OSError) as e:
            self.trouble.failed(e)

    def stop(self) -> None:
        """Write nothing more to the store (another coordinator holds the run now)."""
        self.stopped = True

    def _list(self) -> None:
        """Learn what the store holds, once: what it holds that is not here any more is stale."""
        if self._held is not None:
            return
        here = {p.name for p in self.dir.iterdir()} if self.dir.is_dir() else set()
        self._stale |= {_name(key) for key in self.store.keys(PREFIX)} - here
        self._held = {}

    def _copy(self, name: str) -> None:
        """Put ``state/<name>`` unless the store holds it already, byte for byte."""
        crc = self._written[name] if name in self._written else _crc(self.dir / name)
        if self._held.get(name) == crc:
            return
        keys = None if self.linker is None else self.linker(name, crc, LINK_WAIT)
        if keys is not None:  # hosts' payload objects hold these bytes: name them
            self.store.put(PREFIX + name + LINK, [json.dumps({"keys": keys, "crc": crc}).encode()])
        else:
            with open(self.dir / name, "rb") as f:
                self.store.put(PREFIX + name, iter(lambda: f.read(CHUNK), b""))
        if name in self._held and (name in self._linked) != (keys is not None):  # the other form is left
            self.store.delete([PREFIX + name + ("" if keys is not None else LINK)])
        if keys is not None:
            self._linked.add(name)
        else:
            self._linked.discard(name)
        self._held[name] = crc

    def _prune(self) -> None:
        if self._stale:
            self.store.delete([PREFIX + name + end for name in sorted(self._stale) for end in ("", LINK)])
            for name in self._stale:
                self._held.pop(name, None)
            self._stale.clear()

    # -- taking up, starting over ------------------------------------------------------------------------------
    def fetch(self) -> int | None:
        """Download the store's copy into ``state/`` (which holds no run.json): ``run.json`` last. Returns its
        round, or None when the store holds no run.json. Raises ValueError naming --fresh for one that cannot be
        read, StoreError when the store fails."""
        key = PREFIX + RUN_FILE
        try:
            data = self.store.get(key)
        except StoreMissing:
            return None
        try:
            saved = json.loads(data)
            round_, named = int(saved["round"]), [str(n) for n in saved.get("files", {}).values()]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{self.store.address(key)} cannot be read ({type(e).__name__}: {e}); start with --fresh "
                             "to begin a new run (the store's old state is removed)") from None
        self.dir.mkdir(parents=True, exist_ok=True)
        held: dict[str, int] = {}
        try:
            for name in [*named, f"sync-{round_ + 1}.q4", f"outer-{round_ + 1}.safetensors"]:
                if Path(name).name != name or name == RUN_FILE:
                    raise ValueError(f"{self.store.address(key)} names {name!r}, not a file of the run's state; "
                                     "start with --fresh to begin a new run")
                try:
                    held[name] = write_atomic(self.dir / name, self._read(name))[1]
                except StoreMissing:  # a file it names that is missing is refused with the others at resume
                    (self.dir / f"{name}.tmp").unlink(missing_ok=True)
            held[RUN_FILE] = write_atomic(self.dir / RUN_FILE, [data])[1]
        except BaseException:  # nothing half taken up stays: a start again finds state/ as it was
            for name in held:
                (self.dir / name).unlink(missing_ok=True)
            for tmp in self.dir.glob("*.tmp"):
                tmp.unlink()
            raise
        self._stale |= {_name(k) for k in self.store.keys(PREFIX)} - set(held)
        self._held, self._current = held, True
        return round_

    def _read(self, name: str) -> Iterator[bytes]:
        """``state/<name>``'s bytes: the object, or the payload objects its link names (their CRC checked)."""
        try:
            size = self.store.size(PREFIX + name)
        except StoreMissing:
            size = None
        if size is not None:
            yield from self.store.stream(PREFIX + name, CHUNK)
            return
        link = json.loads(self.store.get(PREFIX + name + LINK))
        crc = 0
        for key in link["keys"]:
            for chunk in self.store.stream(key, CHUNK):
                crc = zlib.crc32(chunk, crc)
                yield chunk
        if crc != link["crc"]:
            raise StoreMissing(f"the objects {PREFIX + name + LINK} names no longer hold its bytes")

    def clear(self) -> int:
        """Remove the store's copy; returns how many objects it held."""
        keys = self.store.keys(PREFIX)
        self.store.delete(keys)
        self._held, self._stale, self._current = {}, set(), False
        return len(keys)


def _name(key: str) -> str:
    """The state file a key of the copy holds (its own bytes, or a link to them)."""
    return key.removeprefix(PREFIX).removesuffix(LINK)


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc

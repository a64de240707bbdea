"""The run's state on disk (``DIR/state/``), so that a coordinator started again on its run directory resumes it.

After every published round, off the critical path (on a thread of its own, while hosts already apply the
sync), the coordinator writes:

- ``sync-R.q4``: round R's sync (a q4 message, ~0.14x the fp32 model), for hosts that had not fetched it yet;
- ``outer-R.safetensors``: the outer optimizer's state (nothing for plain averaging; 1x the fp32 model for
  Nesterov), which belongs to the model after round R; it is written first, before round R-1's sync is
  published (its trailer sent), so a host never holds a model whose outer state is not on disk;
- every ``--snapshot-every`` rounds and at shutdown, ``model-R.safetensors``: the model itself (between
  snapshots, a host that rejoins gives the model back, checked against the saved hash);
- ``run.json`` last: the open round, the model hash and tensor layout, the host registry (each host's state and
  credential, so hosts keep theirs across a restart), the codec and outer-optimizer settings, the names of the
  files above and the outer state's checksum; ``stopped`` when written at shutdown (nothing was published after
  it). It only ever names complete files. A credential issued at a join rewrites ``run.json`` at once (only it);
- ``data-R.json``: the data ledger as it will be after round R-1's publish, written with the outer state before
  that round's sync goes out, so that a restart taking round R's model back from a host takes this ledger too
  (``run.json`` of round R holds it itself, and its save removes this file).

Files are created readable by their owner only (``run.json`` holds the hosts' credentials). A ``run.json`` that
cannot be read, a file it names that is missing, truncated or garbled, or one that holds another round than
``run.json`` says (files of different saves) is refused at start naming ``--fresh``. So is a run directory whose
run saved its state (its events log says so, or ``state/`` holds files) but holds no ``run.json``: starting over
there would leave its hosts waiting on a run that is gone. ``--fresh`` starts over explicitly. A new run moves aside
only :data:`RECORDS`, what a run writes; a user's own files in the directory stay.

Each file is written under a temporary name, synced and renamed, so a crash at any moment leaves the previous
state whole; files that ``run.json`` no longer names are removed once it is replaced. A save cut short leaves
the next round's sync, outer state and data ledger (written before that sync was published) whole beside it
(:meth:`RunStore.interrupted_sync`, :meth:`RunStore.outer_of` and :meth:`RunStore.data_of` find them). A save that
fails changes nothing the store holds (:attr:`RunStore.last` is what ``run.json`` says). Nothing is pickled: JSON
and safetensors (q4 messages are safetensors files too).
With ``--store``, a copier is told of each file written and removed, and copies them to the run's object store
(:mod:`~lightning_nodeox.coordinator.statecopy`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import zlib
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from ..core.files import write_atomic
from ..core.hashing import model_hash
from ..core.logs import Named
from ..core.modelfile import check_model_file, model_header, read_model
from ..core.codecs.settings import CodecSettings, settings_from_json, settings_from_old_keys
from ..core.specs import PayloadError, TensorSpec, specs_from_json
from ..core.wire import Message
from .config import CoordinatorConfig, OuterSettings
from .hosts import HostState
from .runlog import EVENTS_FILE, TB_DIR

log = logging.getLogger(__name__)

STATE_DIR = "state"
# what a run writes into its directory, moved aside at a new run: its state, events log and TensorBoard files,
# the coordinator's address (server.py) and the hosts' folders under ``nodeox launch`` (host/machine.py)
RECORDS = (STATE_DIR, EVENTS_FILE, TB_DIR, "coordinator.json", "hosts")
RUN_FILE = "run.json"
CHECK_ORDER = ("sync", "outer", "model")  # the files run.json names, in the order they are checked (cheapest first)
SAVE_RECORD = b'"phase":"persist"'  # how a save of the run's state reads in the events log (runlog.py)
FORMAT = "nodeox-run-state"
VERSION = 1


@dataclass
class SavedRun:
    """What ``run.json`` holds. ``round`` is the open round; ``model_hash`` the model it starts from."""

    round: int
    model_hash: str
    complete: bool
    hosts: dict[str, dict]  # host id -> {"state": HostState value, "credential": its credential}
    codec: CodecSettings  # saved whole (CodecSettings.to_json; files written before that: loose keys under "q4")
    outer: OuterSettings  # saved whole (a dict of its fields in run.json)
    files: dict[str, str] = field(default_factory=dict)  # "sync", "outer", "model" -> file name in state/
    snapshot_round: int | None = None  # the round whose starting model "model" holds
    snapshot_hash: str | None = None
    specs: list | None = None  # the model's tensor layout (TensorSpec.as_json each); None in older files
    outer_crc: int | None = None  # CRC-32 of the "outer" file's bytes
    stopped: bool = False  # written at shutdown: no round was published after it
    data: dict | None = None  # the data ledger (DataLedger.to_dict: a few kB), if a host declared its data

    def promise(self, model_hash: str | None, round_: int | None) -> tuple[int, str] | None:
        """What a host that rejoins holding ``model_hash`` at ``round_`` can give back: this model, or the next one
        (the coordinator stopped between publishing a round and saving it); None if neither."""
        if model_hash == self.model_hash:
            return self.round, model_hash
        if model_hash and round_ == self.round + 1:
            return round_, model_hash
        return None

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "saved_at": time.time(), **asdict(self),
                "codec": self.codec.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> SavedRun:
        if d.get("format") != FORMAT or int(d.get("version", -1)) != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} file")
        return cls(round=int(d["round"]), model_hash=str(d["model_hash"]), complete=bool(d["complete"]),
                   hosts={str(k): dict(v) for k, v in d["hosts"].items()},
                   codec=settings_from_json(d["codec"]) if "codec" in d else settings_from_old_keys(d["q4"]),
                   outer=OuterSettings(**d["outer"]),
                   files={str(k): str(v) for k, v in d.get("files", {}).items()},
                   snapshot_round=d.get("snapshot_round"), snapshot_hash=d.get("snapshot_hash"),
                   specs=None if d.get("specs") is None else list(d["specs"]),
                   outer_crc=None if d.get("outer_crc") is None else int(d["outer_crc"]),
                   stopped=bool(d.get("stopped", False)), data=d.get("data"))

    def tensor_specs(self) -> tuple[TensorSpec, ...] | None:
        return None if self.specs is None else specs_from_json(self.specs)


def tensor_chunks(named: list[tuple[str, torch.Tensor]], round_: int, model_hash: str) -> list[memoryview]:
    """A safetensors file of ``named`` (contiguous CPU tensors) as views: header, then each tensor's bytes."""
    specs = tuple(TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named)
    views = [memoryview(model_header(specs, round_, model_hash))]
    views += [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for _, t in named]
    return views


class Copier(Protocol):
    """Told of every file :class:`RunStore` writes or removes, on the saving thread (a copy elsewhere: the run's
    object store, :mod:`~lightning_nodeox.coordinator.statecopy`); it never raises."""

    def wrote(self, name: str, crc: int, names: Collection[str] = (), *, copy: bool = True) -> None: ...

    def removed(self, names: Iterable[str]) -> None: ...


class RunStore:
    """Reads and writes ``DIR/state/``; moves a finished run's records aside. ``copier``: told of each file
    written (``run.json`` with the files it names) and removed."""

    def __init__(self, run_dir: Path, copier: Copier | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / STATE_DIR
        self.copier = copier
        self.last: SavedRun | None = None  # what run.json holds (a resumed run's, or the last save that worked)
        self.outer_ahead: tuple[int, str] | None = None  # (round, model hash) of the outer state last written
        self._outer_crc = 0  # CRC-32 of that file's bytes

    def load(self) -> SavedRun | None:
        """The saved run, or None when there is none. A state that cannot be read is an error naming --fresh."""
        path = self.dir / RUN_FILE
        if not path.exists():
            return None
        try:
            saved = SavedRun.from_json(json.loads(path.read_text()))
            for entry in saved.hosts.values():
                HostState(entry["state"])  # a state this version knows
                if not isinstance(entry["credential"], str):
                    raise TypeError("a host's credential is not a string")
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); start with --fresh to begin a new "
                             "run (the old records are moved aside)") from None
        return saved

    def check(self, saved: SavedRun) -> None:
        """Refuse, naming the file and --fresh, a file ``run.json`` names that is missing, truncated or garbled:
        the sync is parsed whole (CRC included), the snapshot hashed (one pass over the model: about 0.35 s per
        80 MB), the outer state's header and size checked. Refuse too a file whose own round (and model, for the
        outer state and the snapshot) is not the one ``run.json`` says it holds."""
        for kind, name in sorted(saved.files.items(), key=lambda item: CHECK_ORDER.index(item[0])):
            path = self.dir / name
            try:
                if kind == "sync":
                    meta = Message.parse(self._read(name)).meta
                    self._same_round(saved, path, (meta.round, None), (saved.round - 1, None))
                    continue
                held = check_model_file(path)
                if kind == "outer":
                    self._same_round(saved, path, held, (saved.round, saved.model_hash))
                    if saved.outer_crc is not None:
                        got = zlib.crc32(memoryview(self._read(name).numpy()))
                        if got != saved.outer_crc:
                            raise PayloadError(f"its bytes have CRC-32 {got:08x}, not the {saved.outer_crc:08x} "
                                               "saved with it")
                if kind == "model" and saved.snapshot_hash is not None:
                    self._same_round(saved, path, held, (saved.snapshot_round, saved.snapshot_hash))
                    _, _, specs, tensors = read_model(self._read(name))
                    got = model_hash([(s.name, t) for s, t in zip(specs, tensors)])
                    if got != saved.snapshot_hash:
                        raise PayloadError(f"its tensors hash to {got}, not the {saved.snapshot_hash} saved with it")
            except (PayloadError, OSError, RuntimeError) as e:
                raise ValueError(f"{path} is missing or damaged ({e}); start with --fresh to begin a new run (the "
                                 "old records are moved aside)") from None

    def _same_round(self, saved: SavedRun, path: Path, held: tuple[int, str | None],
                    said: tuple[int | None, str | None]) -> None:
        """Refuse a file that holds another round (or model) than ``run.json`` says: the two come from different
        saves, and resuming would go on from the wrong model."""
        (round_, hash_), (want_round, want_hash) = held, said
        if round_ == want_round and (want_hash is None or hash_ == want_hash):
            return
        holds = f"round {round_}" + (f" (model {hash_})" if want_hash is not None else "")
        wants = f"round {want_round}" + (f" (model {want_hash})" if want_hash is not None else "")
        raise ValueError(f"{path} holds {holds} but {self.dir / RUN_FILE} (round {saved.round}) says it holds "
                         f"{wants}: they come from different saves. Put back the files saved together, or start "
                         "with --fresh to begin a new run (the old records are moved aside; nothing is deleted)")

    def save(self, saved: SavedRun, *, sync: Message | None, outer: dict[str, torch.Tensor],
             model_chunks: list[memoryview] | None) -> int:
        """Write one round's state (the files, then ``run.json``); returns the bytes written. ``saved.files``
        and its snapshot are taken from :attr:`last` and updated; ``model_chunks`` (a snapshot) is optional, an
        older snapshot stays named until replaced. :attr:`last` becomes ``saved`` once ``run.json`` is written."""
        self.dir.mkdir(parents=True, exist_ok=True)
        r = saved.round
        if self.last is not None:
            saved.files = dict(self.last.files)
            saved.snapshot_round, saved.snapshot_hash = self.last.snapshot_round, self.last.snapshot_hash
        written = 0
        if sync is not None:
            written += self._write(f"sync-{r}.q4", [sync.view()])
            saved.files["sync"] = f"sync-{r}.q4"
        else:
            saved.files.pop("sync", None)
        if outer:
            if self.outer_ahead != (r, saved.model_hash):
                written += self.save_outer(outer, r, saved.model_hash)
            saved.files["outer"], saved.outer_crc = f"outer-{r}.safetensors", self._outer_crc
        else:
            saved.files.pop("outer", None)
            saved.outer_crc = None
        if model_chunks is not None:
            written += self._write(f"model-{r}.safetensors", model_chunks)
            saved.files["model"] = f"model-{r}.safetensors"
            saved.snapshot_round, saved.snapshot_hash = r, saved.model_hash
        written += self._write_run(saved)
        keep = set(saved.files.values()) | {RUN_FILE}
        removed = [path.name for path in self.dir.iterdir() if path.name not in keep]
        for name in removed:
            (self.dir / name).unlink(missing_ok=True)
        if removed and self.copier is not None:
            self.copier.removed(removed)
        return written

    def save_outer(self, outer: dict[str, torch.Tensor], round_: int, model_hash: str) -> int:
        """Write the outer state that belongs to round ``round_``'s model ``model_hash`` (before that round's
        sync is published: a restart then never takes back an older momentum); the next :meth:`save` of that
        round names it without writing it again. Returns the bytes written."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.outer_ahead = None
        name = f"outer-{round_}.safetensors"
        size, self._outer_crc = write_atomic(self.dir / name, tensor_chunks(sorted(outer.items()), round_, model_hash))
        if self.copier is not None:  # copied with the save that names it: the publish waits for this write
            self.copier.wrote(name, self._outer_crc, copy=False)
        self.outer_ahead = (round_, model_hash)
        return size

    def save_data(self, data: dict, round_: int, model_hash: str) -> int:
        """Write the data ledger that belongs to round ``round_``'s model ``model_hash`` (``DataLedger.after``:
        before that round's sync is published, as :meth:`save_outer`): a restart that takes that model back from a
        host takes this ledger with it, not the one of the round before (whose units that model already trained).
        ``run.json`` of that round holds the ledger itself; its save removes this file. Returns the bytes written."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"data-{round_}.json"
        body = json.dumps({"round": round_, "model_hash": model_hash, "data": data}, separators=(",", ":")).encode()
        size, crc = write_atomic(self.dir / name, [body])
        if self.copier is not None:  # a restart from the store's copy resumes from its run.json
            self.copier.wrote(name, crc, copy=False)
        return size

    def data_of(self, round_: int, model_hash: str) -> dict | None:
        """The data ledger a save cut short wrote for round ``round_``'s model ``model_hash``; None when there is
        none (or it is of another model)."""
        try:
            d = json.loads((self.dir / f"data-{round_}.json").read_bytes())
        except (OSError, ValueError):
            return None
        return d.get("data") if (d.get("round"), d.get("model_hash")) == (round_, model_hash) else None

    def save_hosts(self, hosts: dict[str, dict]) -> int:
        """Rewrite ``run.json`` with ``hosts`` (credentials just issued), the rest as it was; nothing when no
        state is saved yet. Returns the bytes written."""
        if self.last is None:
            return 0
        return self._write_run(replace(self.last, hosts=hosts, files=dict(self.last.files)))

    def _write_run(self, saved: SavedRun) -> int:
        size = self._write(RUN_FILE, [json.dumps(saved.to_json(), indent=1).encode()], saved.files.values())
        self.last = saved
        return size

    def _write(self, name: str, chunks: Iterable[bytes | memoryview], names: Collection[str] = ()) -> int:
        """Write ``state/<name>`` and tell the copier (``names``: the files it names); returns its size."""
        size, crc = write_atomic(self.dir / name, chunks)
        if self.copier is not None:
            self.copier.wrote(name, crc, names)
        return size

    def interrupted_sync(self, saved: SavedRun) -> Message | None:
        """The sync a save cut short left beside ``saved``: round ``saved.round``'s, whole and from its model (so
        that round was published), or None."""
        try:
            message = Message.parse(self._read(f"sync-{saved.round + 1}.q4"))
        except (PayloadError, OSError, RuntimeError):
            return None
        meta = message.meta
        return message if (meta.round, meta.base_hash) == (saved.round, saved.model_hash) else None

    def outer_of(self, round_: int, model_hash: str) -> dict[str, torch.Tensor] | None:
        """The outer state a save cut short wrote for round ``round_``'s model ``model_hash`` (whole, of that
        model), by name; None when there is none."""
        try:
            r, h, specs, tensors = read_model(self._read(f"outer-{round_}.safetensors"))
        except (PayloadError, OSError, RuntimeError):
            return None
        return {s.name: t for s, t in zip(specs, tensors)} if (r, h) == (round_, model_hash) else None

    def read_sync(self, saved: SavedRun) -> Message | None:
        name = saved.files.get("sync")
        return None if name is None else Message.parse(self._read(name))

    def read_tensors(self, saved: SavedRun, kind: str) -> tuple[tuple[TensorSpec, ...], list[torch.Tensor]] | None:
        """The specs and tensors of the saved ``"outer"`` state or ``"model"`` snapshot (None if not saved)."""
        name = saved.files.get(kind)
        if name is None:
            return None
        try:
            _, _, specs, tensors = read_model(self._read(name))
        except PayloadError as e:
            raise ValueError(f"{self.dir / name} is damaged ({e}); start with --fresh to begin a new run") from None
        return specs, tensors

    def _read(self, name: str) -> torch.Tensor:
        path = self.dir / name
        return torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)

    def lost_state(self) -> str | None:
        """What shows that a run saved its state here, when ``run.json`` is gone: files left in ``state/``, or a
        save recorded in the events log (said in a few words); None when nothing does."""
        left = sorted(p.name for p in self.dir.iterdir()) if self.dir.is_dir() else []
        if left:
            return f"{self.dir} still holds {', '.join(left[:3])}"
        events = self.run_dir / EVENTS_FILE
        if events.is_file():
            with open(events, "rb") as f:
                if any(SAVE_RECORD in line for line in f):
                    return f"{events} records its saves"
        return None

    def archive(self) -> Path | None:
        """Move the records an earlier run wrote (:data:`RECORDS`) to ``DIR/previous-<timestamp>/``; anything
        else in the directory (a user's own files) stays. Returns where they went, or None when there was
        nothing to move."""
        old = [self.run_dir / name for name in RECORDS if (self.run_dir / name).exists()]
        if not old:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.run_dir / f"previous-{stamp}"
        n = 1
        while target.exists():
            n += 1
            target = self.run_dir / f"previous-{stamp}-{n}"
        target.mkdir()
        for p in old:
            shutil.move(str(p), str(target / p.name))
        return target


def take_up(config: CoordinatorConfig) -> tuple[CoordinatorConfig, SavedRun | None]:
    """The unfinished run saved in the run directory, to resume (its codec and outer optimizer win over the
    command line's), or None for a new run; an earlier run's records are then moved aside, saying where. A run
    whose saved state is gone is refused (ValueError naming ``--fresh``), not started over."""
    said = Named(log, config.name)
    store = RunStore(config.run_dir)
    saved = None if config.fresh else store.load()
    if saved is not None and not saved.complete:
        store.check(saved)
        codec, outer = saved.codec, saved.outer
        if (codec, outer) != (config.codec, config.outer):
            said.warning("the resumed run keeps its codec (%s) and outer optimizer (%s); "
                         "start with --fresh to change them", codec, outer)
        if config.initial_model is not None:
            said.warning("--initial-model is ignored: the run in %s is resumed", config.run_dir)
        return replace(config, codec=codec, outer=outer), saved
    if saved is None and not config.fresh:
        lost = store.lost_state()
        if lost is not None:
            raise ValueError(f"{config.run_dir} holds the records of a run whose state was saved ({lost}) but no "
                             f"{store.dir / RUN_FILE}: its state was deleted or moved. Put {store.dir} back to resume "
                             "the run, or start with --fresh to begin a new run (the old records are moved aside)")
    moved = store.archive()
    if moved is not None:
        why = "--fresh" if config.fresh else ("it held a finished run" if saved is not None else
                                              "it held records of an earlier run")
        print(f"{config.name}: starting a new run in {config.run_dir} ({why}); the earlier records are now in "
              f"{moved}", flush=True)
    return config, None

"""What the coordinator takes in, without losing good input for one bad piece: a telemetry batch keeps its good
records, and ``--initial-model`` takes a file saved by ``safetensors.torch.save_file(model.state_dict())``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests
import torch
from helpers import SPECS, forked, model_file
from safetensors.torch import save_file

from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.core.protocol import CREDENTIAL_HEADER, Refusal
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound
from lightning_nodeox.host.tensors import HostTensors, shared_tensors

pytestmark = pytest.mark.slow  # every test here starts processes

TENSORS = [s.as_json() for s in SPECS]


def record(round_: int, **fields) -> dict:
    return {"round": round_, "host": "a", "phase": "encode", "start": 1.0 + round_, "end": 2.0 + round_, **fields}


def test_one_bad_telemetry_record_is_dropped_and_counted_and_the_rest_of_its_batch_written(coordinator) -> None:
    coord = coordinator(1)
    a = HttpClient(coord.url, host="a", retry_for=5)
    credential = a.join(TENSORS).credential
    a.put_model(memoryview(model_file()))

    def post(records: list) -> requests.Response:
        return requests.post(f"{coord.url}/v1/events", params={"host": "a"}, json={"records": records},
                             headers={CREDENTIAL_HEADER: credential}, timeout=30)

    batch = [record(0), record(1, phase="mining"), record(2, bytes=7), {"round": 3}, record(4, start=9.0, end=1.0),
             record(5, note="x")]
    response = post(batch)
    assert response.status_code == 200
    answer = response.json()
    assert (answer["written"], answer["dropped"]) == (3, 3)
    assert "phase 'mining' is not one of" in answer["error"]  # the first bad record's reason
    written = [e for e in coord.events() if e["host"] == "a"]
    assert [(e["round"], e.get("bytes"), e.get("note")) for e in written] == [(0, None, None), (2, 7, None),
                                                                              (5, None, "x")]

    whole = post([record(6, phase="mining"), record(7, bytes=-1)])  # every record bad: the batch is malformed
    assert whole.status_code == 400 and whole.json()["reason"] == "invalid"
    assert "phase 'mining' is not one of" in whole.json()["error"]
    another = post([record(8), {**record(9), "host": "b"}])  # another host's record: refused whole, as before
    assert another.status_code == 403
    assert [e["round"] for e in coord.events() if e["host"] == "a"] == [0, 2, 5]


class Net(torch.nn.Module):
    """Layers declared z before a: ``state_dict`` lists z's tensors first, ``save_file`` stores a's first."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.z = torch.nn.Linear(6, 5)
        self.a = torch.nn.BatchNorm1d(5)
        self.a.running_mean.uniform_()


def saved_by_safetensors(net: torch.nn.Module, path, **changes) -> None:
    state = {**net.state_dict(), **changes}
    save_file({k: v for k, v in state.items() if v is not None}, str(path))


def file_order(path) -> list[str]:
    length = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + length])
    header.pop("__metadata__", None)
    return [name for name, _ in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])]


def test_an_initial_model_saved_by_safetensors_save_file_is_matched_by_name(coordinator, tmp_path) -> None:
    start = Net(0)
    path = tmp_path / "start.safetensors"
    saved_by_safetensors(start, path)
    names = [n for n, _ in shared_tensors(start)]
    assert names[:2] == ["z.weight", "z.bias"] and file_order(path)[0].startswith("a.")  # another order
    assert "a.num_batches_tracked" in file_order(path) and "a.num_batches_tracked" in names  # travels raw

    coord = coordinator(2, "--initial-model", str(path))
    hosts = [HostRound(HostTensors(shared_tensors(Net(seed))), HttpClient(coord.url, host=h, retry_for=30),
                       PhaseLog(h)) for seed, h in ((1, "a"), (2, "b"))]
    for h in hosts:
        h.join()  # each fetches the initial model: its own weights differ
    expected = model_hash(shared_tensors(start))
    for h in hosts:
        assert h.model_hash == expected
        assert all(torch.equal(t, dict(shared_tensors(start))[n]) for n, t in zip(h.tensors.names, h.tensors.live))
    assert requests.get(f"{coord.url}/v1/status", timeout=10).json()["model_hash"] == expected
    assert "skipped" not in coord.log_path.read_text()  # every tensor of the file is the model's
    for h in hosts:
        h.close()


def test_an_initial_model_that_lacks_or_adds_tensors_is_refused_naming_them(coordinator, tmp_path) -> None:
    net = Net(0)
    path = tmp_path / "other.safetensors"
    saved_by_safetensors(net, path, **{"z.bias": None, "head.weight": torch.zeros(3)})
    coord = coordinator(1, "--initial-model", str(path))
    with pytest.raises(Refusal) as refused:
        HttpClient(coord.url, host="a", retry_for=5).join([s.as_json() for s in HostTensors(shared_tensors(net)).specs])
    assert refused.value.reason.value == "invalid"
    assert "missing ['z.bias'], extra ['head.weight']" in str(refused.value)
    status = requests.get(f"{coord.url}/v1/status", timeout=10).json()
    assert status["model_hash"] is None and status["hosts"] == {}  # refused and not registered


def test_an_initial_model_that_is_not_a_model_file_stops_the_coordinator_at_once_naming_it(tmp_path) -> None:
    path = tmp_path / "notes.safetensors"
    path.write_text("not a model")
    done = subprocess.run(forked([sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", "1", "--run-dir",
                                  str(tmp_path / "run"), "--initial-model", str(path)]), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "--initial-model is truncated or corrupt" in done.stderr and "Traceback" not in done.stderr + done.stdout

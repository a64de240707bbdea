"""Two hosts exchanging a fixed number of rounds against a coordinator process, for the tests of restarts: the
same run, interrupted or not, must end on the same model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from helpers import frozen, model, train_on_model

from lightning_nodeox.core.phases import PhaseLog
from lightning_nodeox.host.client import HttpClient
from lightning_nodeox.host.round import HostRound

ROUNDS = 5
NESTEROV = ("--outer-optimizer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9")
AVERAGE = ("--outer-optimizer", "average")
TUNED = ("--outer-optimizer", "nesterov", "--outer-lr", "0.5", "--outer-momentum", "0.8")  # every setting not its default


def run(url: str, interrupt=None, at_round: int = 2, still: tuple[str, ...] = (), fragments: int = 1) -> list[str]:
    """Two hosts a and b exchange ROUNDS rounds; ``interrupt()`` runs once host a has sent round ``at_round``'s
    delta (so that round cannot close before it); the tensors ``still`` are frozen parameters on both; each round
    exchanges one of ``fragments`` (the last one all). Returns each host's final model hash."""
    hosts = [HostRound(frozen(model(seed), still, fragments), HttpClient(url, host=h, retry_for=60), PhaseLog(h))
             for seed, h in enumerate("ab")]
    for h in hosts:
        h.join()
    with ThreadPoolExecutor(2) as pool:
        for r in range(ROUNDS):
            final = r == ROUNDS - 1
            for k, h in enumerate(hosts, 1):
                train_on_model(h, k, r)
                h.tensors.boundary(h.round, final=final)
                assert h.upload(h.encode(h.tensors.live, 16, final)).value == "taken"
                if (r, h.host) == (at_round, "a") and interrupt is not None:
                    interrupt()
            results = list(pool.map(lambda h, f=final: h.synchronize(follow_to_end=f), hosts))
            assert [res.round for res in results] == [r, r]
    for h in hosts:
        h.client.leave()
        h.close()
    return [h.model_hash for h in hosts]

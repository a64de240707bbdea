"""A host joining the run, and the rules that keep its model the run's, each in terms of the protocol's outcomes
(never HTTP):
- at join the hosts agree on the starting model: this host provides it when asked, keeps its own if equal, or
  fetches the coordinator's;
- a coordinator that no longer knows this host or has no model (``NOT_JOINED``, ``NO_MODEL``: it restarted)
  is joined again, telling it which model this host holds: it may ask for that model back (the round's
  base θ_r, which every host holds bit-identical), or the host fetches the coordinator's if it differs;
- a data lease that a restarted coordinator refuses (``NOT_JOINED``, ``NO_MODEL``: it leases nothing until its
  model is back) is asked again once this host joined again (:meth:`Joining.lease`);
- values exchanged outside a round that a restarted coordinator refuses (``NOT_JOINED``) are posted again once
  this host joined again (:meth:`Joining.exchange_values`), so no host falls back to its own values;
- the full model is fetched when nothing else makes this host's model the run's (:meth:`Joining.fetch_model`);
  a download of it that breaks off is asked for again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..core import phases as P
from ..core.ledger_terms import LeaseReply
from ..core.protocol import Reason, Refusal, TransferBroken, ValuesReply
from ..core.codecs import codec_for
from ..core.specs import ModelMismatchError, PayloadError
from .ending import run_completed
from .standing import Into, Standing
from .waiting import WaitLine

DOWNLOAD_TRIES = 3
REJOIN_TRIES = 3
REJOIN = (Reason.NOT_JOINED, Reason.NO_MODEL)
REJOIN_WAIT = 0.2  # seconds between values posts while the exchange in flight joins again


class Joining:
    """Joins ``standing``'s host to the run, joins again when the coordinator forgot it, fetches the model."""

    def __init__(self, standing: Standing, *, rounding: str, error_feedback: bool, codec_threads: int) -> None:
        self.standing = standing
        self.rounding = rounding
        self.error_feedback = error_feedback
        self.codec_threads = codec_threads

    def join(self) -> None:
        """Join the run and agree on the starting model (provide it, keep ours if equal, or fetch it)."""
        s = self.standing
        reply = self._join_reply(None)
        if reply.complete:
            raise run_completed(s.client.url, reply.round - 1, reply.model_hash)
        codec_for(reply.codec).check_rounding(self.rounding)
        s.tensors.allocate(reply.codec, self.codec_threads, error_feedback=self.error_feedback)
        s.round = reply.round
        ours = s.tensors.base_hash()  # base is a copy of the live model here
        if reply.provide_model:
            self._provide(ours)
        elif ours == reply.model_hash:
            s.model_hash = ours
        else:
            self.fetch_model(Into.LIVE)

    def _provide(self, ours: str) -> None:
        """Upload this host's model as the run's first (the coordinator asked), or fetch the one another host
        provided meanwhile."""
        s = self.standing
        s.model_hash = ours
        try:
            with s.phases.timed(s.round, P.PROVIDE_MODEL) as rec:
                body = s.tensors.model_file(s.round, ours)
                rec.bytes = len(body)
                theirs = s.client.put_model(body)
        except Refusal as e:
            if e.reason is not Reason.HAS_MODEL:
                raise
            self.fetch_model(Into.LIVE)  # another host provided it meanwhile
            return
        if theirs != ours:
            raise RuntimeError(f"coordinator hashed the initial model as {theirs}, this host as {ours}; "
                               "versions differ?")
        s.log.info("host %s provided the initial model %s", s.host, ours)

    def _join_reply(self, model_hash: str | None):
        s = self.standing
        specs = [spec.as_json() for spec in s.tensors.specs]
        reply = s.client.join(specs, model_hash=model_hash, round_=s.round)
        waiting = WaitLine(f"host {s.host} waits for the run's model to join")
        while reply.retry:  # another host is providing the model
            waiting.still("the coordinator has none yet: another host provides it, or a restarted coordinator waits "
                          "for a host to give it back (its own log says which)")
            reply = s.client.join(specs, model_hash=model_hash, round_=s.round)
        return reply

    def rejoin(self, into: Into = Into.LIVE, *, fetch: bool = True) -> None:
        """Join again, keeping this host's model and round (the coordinator restarted or forgot this host): give
        the round's base model back if asked, fetch the coordinator's (``into``) if it differs (unless ``fetch``
        is False: the next round's upload then finds its base stale and fetches it)."""
        s = self.standing
        reply = self._join_reply(None if s.base_changed else s.model_hash)  # a half-changed base is no model
        if reply.complete:
            s.complete = True
            return
        theirs = self._give_back() if reply.provide_model else reply.model_hash
        if theirs != s.model_hash and fetch or s.base_changed:
            self.fetch_model(into)
            return
        s.log.info("host %s joined again at round %d%s", s.host, s.round,
                   " and gave the model back" if reply.provide_model else "")

    def _give_back(self) -> str | None:
        """Upload θ_r (the round's base, what every host holds); returns the coordinator's model hash."""
        s = self.standing
        try:
            return s.client.put_model(s.tensors.model_file(s.round, s.model_hash, s.tensors.base))
        except Refusal as e:
            if e.reason is not Reason.HAS_MODEL:
                raise
            return e.extra.get("model_hash")  # another host gave it back first

    def call(self, fn, *args, into: Into, fetch: bool = True, **kwargs):
        """A call to the coordinator; if it no longer knows this host or has no model (it restarted), join again
        (a model fetched meanwhile goes ``into``; ``fetch`` False: none is, see :meth:`rejoin`) and call once
        more."""
        for attempt in range(1, REJOIN_TRIES + 1):
            try:
                return fn(*args, **kwargs)
            except Refusal as e:
                if e.reason not in REJOIN or attempt == REJOIN_TRIES:
                    raise
                self.standing.log.warning("host %s: %s; joining again", self.standing.host, e)
                self.rejoin(into, fetch=fetch)

    def lease(self, epoch: int | None, units: int = 1) -> LeaseReply:
        """Units of the data ledger (:meth:`HttpClient.lease`), mid-round: a restarted coordinator is joined again
        as by the other calls (this host may give its model back), the model kept (the round's upload finds a base
        gone stale and fetches it). Its ledger voided every lease: the reply is of a new generation, and the
        sampler drops what it held (:class:`~lightning_nodeox.host.ledger_sampler.LedgerSampler`)."""
        return self.call(self.standing.client.lease, epoch, units, into=Into.LIVE, fetch=False)

    def exchange_values(self, key: str, payload: object, *, retry_for: float,
                        joins: Callable[[], bool]) -> ValuesReply:
        """Values under ``key`` with the other hosts (:mod:`lightning_nodeox.coordinator.values`). A coordinator
        that no longer knows this host (it restarted) is joined again and the values posted again, for up to
        ``retry_for`` seconds (then its refusal is raised): by this call when ``joins()`` (no exchange in flight;
        the model is not fetched here, so every rank keeps it), else by the exchange in flight, which it waits
        for."""
        s = self.standing
        deadline = time.monotonic() + retry_for
        while True:
            try:
                return s.client.exchange_values(key, payload)
            except Refusal as e:
                if e.reason not in REJOIN or time.monotonic() >= deadline:
                    raise
                if joins():
                    s.log.warning("host %s: values %s: %s; joining again", s.host, key, e)
                    self.rejoin(fetch=False)
                else:
                    time.sleep(REJOIN_WAIT)

    def fetch_model(self, into: Into = Into.LIVE) -> None:
        """Replace this host's model with the coordinator's (the fallback when a sync cannot be applied),
        streamed straight into the live model (then θ_r := it) or into base only; a download that breaks off is
        asked for again."""
        s = self.standing
        tensors = s.tensors
        target = tensors.live if into is Into.LIVE else tensors.base
        with s.phases.timed(s.round, P.FALLBACK_FETCH) as rec:
            for attempt in range(1, DOWNLOAD_TRIES + 1):
                body = self.call(s.client.get_model, into=into)
                rec.bytes = body.size
                try:
                    round_, remote_hash = tensors.read_model(body, target)
                    break
                except ModelMismatchError:
                    raise
                except (TransferBroken, PayloadError) as e:
                    if attempt == DOWNLOAD_TRIES:
                        raise
                    s.log.warning("host %s: model download failed (%s); retrying", s.host, e)
            tensors.after_fetch(into is Into.LIVE)
            got = tensors.base_hash()  # base holds the fetched model now, in either case
            if got != remote_hash:
                raise RuntimeError(f"the fetched model hashes to {got}, not the coordinator's {remote_hash}")
            s.round, s.model_hash, s.base_changed = round_, got, False
        s.log.info("host %s fetched the model of round %d (%s)", s.host, round_, got)

"""Who may act in the run: admission, credentials, the host that provides the model, and leases.

Identity: a join admits a host id (at most ``--hosts`` distinct ids unless ``--elastic``) and returns a
credential that every later call of that host must present (:meth:`Membership.authenticate`). An id already held
by a live host is refused (``ID_IN_USE``); it can be taken again once its holder has left or was dropped (its
lease expired), by a join presenting the holder's credential, or, in a resumed run, while its holder has not been
heard from since the restart. Taking it issues a new credential, so the
previous holder, should it still run, is refused from then on. Credentials are part of the saved run state,
written when issued, so hosts keep acting (and rejoin) with theirs across a coordinator restart.

The model's provider: while the run has no model, the first host to join provides it (a resumed run: the first
that holds its model, :mod:`~lightning_nodeox.coordinator.recovery`); another may take over once
``--provider-timeout`` has passed without it. Only the provider may upload the model, only while the run has
none, and only of the size its join's tensor specs give; other hosts that join meanwhile wait (one long poll)
and are told to try again.

Leases (the rules are in :mod:`~lightning_nodeox.coordinator.hosts`): a host that leaves or whose lease expires is
no longer waited for, so the open round may close. It never ends the run: when no host is live, the run waits for
its hosts to come back, up to ``--no-hosts-timeout`` seconds, and then the coordinator stops with the run
unfinished (it resumes when started again).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time

import torch

from ..core.logs import Named
from ..core.modelfile import arrange, model_header, read_model
from ..core.protocol import DataSpec, JoinReply, Reason, Refusal
from ..core.specs import PayloadError, TensorSpec, check_same_model
from .hosts import Host, HostState
from .intake import model_bytes
from .link import SiteLink
from .recovery import Recovery
from .rounds import Rounds
from .runstate import RunState

log = logging.getLogger(__name__)


class Membership:
    """Admission and identity of hosts, the model's provider, and what leaving or a lapsed lease does to a round."""

    def __init__(self, state: RunState, recovery: Recovery, rounds: Rounds, site: SiteLink | None = None) -> None:
        """``site``: the run's model comes from (or goes to) upstream (a site relay)."""
        self.state = state
        self.site = site
        self.log = Named(log, state.config.name)
        self.recovery = recovery
        self.rounds = rounds
        self.provider: str | None = None  # the host asked to upload the model
        self.provider_since = 0.0  # time.time() when it was asked
        self.provider_specs: tuple[TensorSpec, ...] = ()  # the tensors it declared at join
        self.initial: dict[str, torch.Tensor] | None = None  # --initial-model's tensors by name, until a join
        self._taking_initial = asyncio.Lock()

    # -- joining --------------------------------------------------------------------------------------------
    async def join(self, host: str, specs: tuple[TensorSpec, ...], credential: str = "",
                   model_hash: str | None = None, round_: int | None = None,
                   data: DataSpec | None = None) -> JoinReply:
        """Admit a host (see the module's rules on ids); tell it the round, the model hash and its credential, or
        that it must provide the model. A host that rejoins a resumed run says which model and round it holds
        (``model_hash``, ``round_``), so that it can give the model back. A host whose model does not fit the run
        is refused and not registered, and so is one whose ``data`` is not the run's (:mod:`.data`)."""
        state, recovery = self.state, self.recovery
        self._check_admission(host, credential)
        if data is not None:  # (a site relay's first: before it joins upstream, which it declares the data to)
            state.data.declare(host, data)
        if self.site is not None and state.model is None and recovery.resumed is None:
            await self.site.before_join(specs)
        if state.model is None and self.initial is not None:
            await self._take_initial_model(host, specs)
        if state.model is None:
            now = time.time()
            free = self.provider in (None, host) or now - self.provider_since > state.config.provider_timeout
            resumed = recovery.resumed is not None
            promise = await recovery.promise(host, specs, model_hash, round_)
            if free and (not resumed or promise is not None):
                if not await self._can_keep_credentials():
                    return self._reply(model_hash=None, retry=True)
                self.provider, self.provider_since, self.provider_specs = host, now, specs
                recovery.wanted = promise
                issued = await self._register(host, credential)
                return self._reply(model_hash=None, provide_model=True, credential=issued)
            await state.wait(lambda: state.model is not None, state.config.long_poll)
            if state.model is None:
                return self._reply(model_hash=None, retry=True)
        try:
            check_same_model(state.model.specs, specs, f"host {host}'s model")
        except PayloadError as e:
            raise Refusal(Reason.INVALID, str(e)) from None
        if not await self._can_keep_credentials():
            return self._reply(model_hash=None, retry=True)
        issued = await self._register(host, credential)
        await state.notify()
        return self._reply(model_hash=state.model.hash, complete=state.complete, credential=issued)

    async def _can_keep_credentials(self) -> bool:
        """Whether a credential issued now is written to disk (no save is failing), after waiting up to one long
        poll for that; when not, the host is told to join again (a credential a restart forgot would lock its
        host out)."""
        recovery = self.recovery
        if not recovery.durable:
            await self.state.wait(lambda: recovery.durable, self.state.config.long_poll)
        return recovery.durable

    async def _take_initial_model(self, host: str, specs: tuple[TensorSpec, ...]) -> None:
        """``--initial-model``'s tensors, arranged as the first joining host's specs, become the run's model."""
        async with self._taking_initial:  # hosts joining at once: one makes the model, the others find it made
            if self.state.model is not None:
                return
            try:
                tensors = arrange(self.initial, specs, f"--initial-model, for host {host}'s model,")
            except PayloadError as e:
                raise Refusal(Reason.INVALID, str(e)) from None
            model = await self.state.build_model(specs, tensors)
            self.initial = None
            await self.recovery.model_arrived(model, "--initial-model")

    def _reply(self, **fields) -> JoinReply:
        config = self.state.config
        return JoinReply(round=self.state.round, codec=config.codec, store_deltas=config.store_deltas, **fields)

    def _check_admission(self, host: str, credential: str) -> None:
        config = self.state.config
        entry = self.state.hosts.get(host)
        if entry is None:
            if len(self.state.hosts) >= config.hosts and not config.elastic:
                raise Refusal(Reason.FULL, f"host {host} cannot join: the run already has its {config.hosts} "
                                           "hosts (--hosts). A restarted host must keep its NODEOX_HOST_ID to take its "
                                           "place; start the coordinator with --elastic to admit more hosts")
        elif not self.state.hosts.takeable(entry) and not _same(credential, entry.credential):
            raise Refusal(Reason.ID_IN_USE, f"host id {host} is in use by another live process (joined "
                                            f"{time.time() - entry.joined:.0f} s ago, {entry.state.value}). Give this "
                                            "process its own NODEOX_HOST_ID, or stop the other one first (a stopped "
                                            "host leaves; one that died is free again once its --lease expires)")

    async def _register(self, host: str, credential: str) -> str:
        """Admit ``host`` (checked again: no await since) and return its new credential, once on disk (saved at
        issue time: after a crash, even right after the reply, the credential it replaced stays refused)."""
        self._check_admission(host, credential)
        entry = self.state.hosts.register(host, secrets.token_urlsafe(24))
        writing = self.recovery.save_hosts()
        self.log.info("host %s joined", host)
        if writing is not None:
            await writing
        return entry.credential

    def authenticate(self, host: str, credential: str, *, left_ok: bool = False) -> Host:
        """The host ``host``, if ``credential`` is its credential (from its join) and it has not left (unless
        ``left_ok``: a goodbye said again)."""
        entry = self.state.hosts.get(host)
        if entry is None:
            raise Refusal(Reason.NOT_JOINED, f"host {host} has not joined; POST /v1/join first")
        if not _same(credential, entry.credential):
            raise Refusal(Reason.FORBIDDEN, f"missing or wrong credential for host {host}: only the process that "
                                            f"joined as {host} may act for it (if that process restarted, it joins "
                                            "again)")
        if entry.state is HostState.LEFT and not left_ok:
            raise Refusal(Reason.FORBIDDEN, f"host {host} left the run: its credential no longer acts for it; "
                                            "join again to take part")
        return entry

    # -- the model's provider -------------------------------------------------------------------------------
    def check_model_upload(self, host: str, size: int) -> None:
        """Refuse a model upload before its body is read (or allocated for): only the chosen provider, only when
        the run has none, and only of the size its join's tensor specs give."""
        model = self.state.model
        if model is not None:
            raise Refusal(Reason.HAS_MODEL, "the run already has a model; fetch it with GET /v1/model",
                          model_hash=model.hash)
        if host != self.provider:
            raise Refusal(Reason.NOT_PROVIDER, f"host {self.provider} provides the model, not host {host}; join again")
        data = model_bytes(self.provider_specs)
        header = len(model_header(self.provider_specs, self.state.round, "f" * 128))  # at most: metadata varies
        if not data < size <= data + header:
            raise Refusal(Reason.INVALID, f"model upload of {size} bytes does not fit the {len(self.provider_specs)} "
                                          f"tensors host {host} declared at join ({data} bytes and a header of at "
                                          f"most {header})")

    async def put_model(self, host: str, data: torch.Tensor) -> dict:
        """The providing host's model: the run's initial model, or a resumed run's model given back."""
        self.check_model_upload(host, data.numel())
        try:
            _, _, specs, tensors = await self.state.in_parser(read_model, data)
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"model rejected: {e}") from None
        try:
            check_same_model(self.provider_specs, specs, "the model")
        except PayloadError as e:
            raise Refusal(Reason.INVALID, f"{e} (as declared at join)") from None
        model = await self.state.build_model(specs, tensors)
        self.check_model_upload(host, data.numel())  # another upload may have won while this one was read
        wanted = self.recovery.wanted
        if wanted is not None and model.hash != wanted[1]:
            self.provider = None
            raise Refusal(Reason.INVALID, f"host {host}'s model hashes to {model.hash}, not the {wanted[1]} it "
                                          "said it holds")
        await self.recovery.model_arrived(model, f"host {host}")
        return {"model_hash": model.hash, "round": self.state.round}

    # -- leaving and leases ---------------------------------------------------------------------------------
    async def heartbeat(self, host: str) -> dict:
        self.state.hosts.seen(self.state.hosts.known(host))
        return {"lease": self.state.config.lease, "round": self.state.round}

    async def leave(self, host: str) -> None:
        """A host stops taking part (training ended or failed); rounds no longer wait for it."""
        entry = self.state.hosts.get(host)
        if entry is not None:
            entry.state = HostState.LEFT
        self.state.data.gone(host, in_round=host in self.rounds.deltas.by_host)
        await self.rounds.maybe_close()
        self.rounds.check_finished()
        await self.state.notify()

    async def check_leases(self) -> None:
        """Drop training hosts not heard from within the lease (rounds stop waiting for them); the run may have
        finished (every host gone), or have had no live host for ``--no-hosts-timeout`` (it gives up)."""
        expired = self.state.hosts.expire()
        for entry in expired:
            self.state.data.gone(entry.id, in_round=entry.id in self.rounds.deltas.by_host)
        if expired:
            await self.rounds.maybe_close()
            await self.state.notify()
        self.rounds.check_finished()
        self._check_alone()

    def _check_alone(self) -> None:
        """Note since when no host is live; past ``--no-hosts-timeout`` the coordinator stops, resumable."""
        state = self.state
        if state.complete or not state.hosts or state.hosts.live() or state.hosts.all_finished():
            state.alone_since = None
            return
        now = time.monotonic()
        if state.alone_since is None:
            state.alone_since = now
            self.log.warning("no host is live (%s); the run waits for them up to %g s (--no-hosts-timeout)",
                             state.hosts.absent(), state.config.no_hosts_timeout)
        elif now - state.alone_since >= state.config.no_hosts_timeout and not state.given_up.is_set():
            self.log.error("no host was live for %.0f s (--no-hosts-timeout %g): stopping with the run unfinished "
                           "at round %d; start the coordinator again on %s to resume it", now - state.alone_since,
                           state.config.no_hosts_timeout, state.round, state.config.run_dir)
            state.given_up.set()


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())

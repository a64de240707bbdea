"""Which tensors travel (host/parts.py): the delta's set at each boundary (frozen parameters stay home, one
fragment a round), each set's layout and message made once, and a sync's set as this host's indices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import PayloadError, spec_of
from lightning_nodeox.core.wire import Message, MessageLayout
from lightning_nodeox.host.parts import Parts

NAMED = [("w", torch.randn(50, 40)), ("b", torch.randn(50)), ("head", torch.randn(50, 40)), ("n", torch.tensor(3))]
SPECS = spec_of(NAMED)


def parts(frozen: tuple[str, ...] = (), fragments: int = 1) -> tuple[Parts, list[nn.Parameter | None]]:
    params = [nn.Parameter(t.clone(), requires_grad=False) if n in frozen else None for n, t in NAMED]
    p = Parts([n for n, _ in NAMED], SPECS, params, fragments)
    p.allocate(Q4Settings(), pin_memory=False)
    return p, params


def test_frozen_parameters_stay_home_and_each_set_keeps_its_part() -> None:
    p, params = parts(frozen=("head",))
    first = p.boundary(None)
    assert first.indices == (0, 1, 3) and first.raw == [2] and p.part is first
    assert first.layout.specs == tuple(SPECS[i] for i in (0, 1, 3)) and first.message is not None
    params[2].requires_grad_(True)  # unfrozen: it moves from the next boundary on
    assert p.boundary(None).indices == (0, 1, 2, 3)
    params[2].requires_grad_(False)
    assert p.boundary(None).indices == (0, 1, 2, 3)  # frozen during the round: its change is sent once more
    assert p.boundary(None) is first  # the set changed back: its part (and message) is found again


def test_a_round_takes_its_fragment_and_the_final_round_all() -> None:
    p, _ = parts(fragments=2)
    cut = p.fragments.cut((0, 1, 2, 3))
    assert p.fragment_count == 1  # no boundary yet: nothing moves
    assert p.boundary(0).indices == cut[0] and len(cut) == p.fragment_count == 2
    assert p.boundary(1).indices == cut[1] and p.boundary(2).indices == cut[0]
    assert p.boundary(None).indices == (0, 1, 2, 3)
    assert p.take_part(1).indices == cut[1]


def test_a_frozen_parameter_written_anyway_moves_from_the_boundary_that_finds_it() -> None:
    p, params = parts(frozen=("head",))
    live = [t.clone() for _, t in NAMED]
    base = [t.clone() for t in live]
    assert p.frozen_changed(live, base) == []
    live[2].add_(1.0)  # an EMA teacher
    assert p.frozen_changed(live, base) == ["head"]
    p.watch_frozen(live, base)
    assert p.boundary(None).indices == (0, 1, 2, 3) and p.frozen_changed(live, base) == []


def test_a_syncs_tensors_become_this_hosts_indices_or_a_payload_error() -> None:
    p, _ = parts()
    sync = Message.allocate(MessageLayout.of((SPECS[1], SPECS[3]), Q4Settings()))
    assert p.sync_part(sync).indices == (1, 3) and p.sync_part(sync) is p.sync_part(sync)
    other = Message.allocate(MessageLayout.of(spec_of([("x", torch.zeros(3))]), Q4Settings()))
    with pytest.raises(PayloadError):
        p.sync_part(other)

"""The round's phase (coordinator/phase.py): each transition, and the ones it does not have."""

from __future__ import annotations

import pytest

from lightning_nodeox.coordinator.phase import Phase, PhaseError, RoundPhase


def test_a_root_round_opens_closes_and_opens_again_with_downloads_held_only_while_it_closes() -> None:
    phase = RoundPhase()
    assert (phase.phase, phase.may_close, phase.stable, phase.closing) == (Phase.OPEN, True, True, False)
    phase.begin_close()
    assert (phase.phase, phase.may_close, phase.stable, phase.closing) == (Phase.CLOSING, False, False, True)
    phase.end_close()
    assert phase.phase is Phase.OPEN


def test_a_relays_close_lets_downloads_start_while_it_waits_upstream_until_theta_is_held_again() -> None:
    phase = RoundPhase()
    phase.begin_close()
    phase.steady()
    assert (phase.phase, phase.stable, phase.closing) == (Phase.UPSTREAM, True, True)
    assert phase.hold() is True  # the upstream's sync is about to change θ
    assert (phase.phase, phase.stable) == (Phase.CLOSING, False)
    assert phase.hold() is False  # already held: nothing more to do
    phase.end_close()
    assert phase.phase is Phase.OPEN


def test_theta_held_outside_a_close_is_released_and_a_close_may_begin_meanwhile() -> None:
    phase = RoundPhase()
    assert phase.hold() is True
    assert (phase.phase, phase.stable, phase.may_close) == (Phase.HELD, False, True)
    phase.release()
    assert phase.phase is Phase.OPEN
    phase.hold()
    phase.begin_close()  # a round may close while a relay adopts its upstream's model: θ changes either way
    phase.release()  # the adoption ended: the close still holds θ
    assert phase.phase is Phase.CLOSING


def test_a_stop_asked_while_a_round_closes_takes_effect_once_it_has_published() -> None:
    phase = RoundPhase()
    phase.begin_close()
    phase.stop()
    assert phase.phase is Phase.CLOSING and phase.closing
    phase.end_close()
    assert (phase.phase, phase.may_close, phase.stable) == (Phase.STOPPED, False, True)
    open_one = RoundPhase()
    open_one.stop()
    assert open_one.phase is Phase.STOPPED


@pytest.mark.parametrize("start, move", [(Phase.CLOSING, "begin_close"), (Phase.STOPPED, "begin_close"),
                                         (Phase.OPEN, "steady"), (Phase.OPEN, "end_close"),
                                         (Phase.HELD, "end_close"), (Phase.UPSTREAM, "steady")])
def test_a_transition_the_phase_does_not_have_is_refused_and_changes_nothing(start: Phase, move: str) -> None:
    phase = RoundPhase()
    phase.phase = start
    with pytest.raises(PhaseError, match=f"cannot go from {start.value}"):
        getattr(phase, move)()
    assert phase.phase is start

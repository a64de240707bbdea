"""`nodeox launch`'s console: a child's terminal output rendered as the lines a terminal settles on (progress bars
in their last state, no escape sequences), and Lightning's chatter and Python warnings shown once per launch."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from lightning_nodeox.tools.console import Console, OncePerLaunch
from lightning_nodeox.tools.screen import MAX_OSC, MAX_ROWS, Screen


def rendered(text: str, chunk: int | None = None) -> list[str]:
    """The lines a Screen shows of ``text``, fed whole or ``chunk`` characters at a time."""
    screen = Screen()
    step = chunk or len(text) or 1
    lines = [line for i in range(0, len(text), step) for line in screen.feed(text[i:i + step])]
    return lines + screen.close()


def lightning_like_fit() -> str:
    """What Lightning's TQDMProgressBar writes for two epochs of 6 batches: one main bar reused across epochs, a
    nested validation bar (position 1, cleared at its end) every epoch, and a line through the bar (tqdm.write)."""
    out = io.StringIO()
    main = tqdm(total=6, desc="Epoch 0", file=out, mininterval=0, leave=True, position=0)
    for epoch in range(2):
        main.reset(total=6)
        main.set_description(f"Epoch {epoch}")
        for i in range(6):
            main.update(1)
            main.set_postfix(loss=f"{1.0 / (epoch * 6 + i + 1):.3f}")
            if i == 2:
                tqdm.write(f"nodeox: host 0 round {epoch}, step {epoch * 6 + 3}", file=out)
        val = tqdm(total=3, desc="Validation DataLoader 0", file=out, mininterval=0, leave=False, position=1)
        for _ in range(3):
            val.update(1)
        val.close()
    main.close()
    return "GPU available: False, used: False\n" + out.getvalue() + "host 0: evaluating the final model\n"


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_nested_tqdm_bars_show_their_last_state_and_no_escape_sequence(chunk) -> None:
    text = lightning_like_fit()
    assert "\x1b[A" in text and text.count("\r") > 30  # what a terminal gets: redraws and cursor moves
    lines = rendered(text, chunk)
    assert lines[:2] == ["GPU available: False, used: False", "nodeox: host 0 round 0, step 3"]
    assert lines[2] == "nodeox: host 0 round 1, step 9"
    assert lines[3].startswith("Epoch 1: 100%|##########| 6/6 [") and lines[3].endswith(", loss=0.083]")
    assert lines[4:] == ["host 0: evaluating the final model"]  # the cleared validation bars show nothing
    assert not any("\x1b" in line or "\r" in line for line in lines)


def test_erases_colours_and_titles_are_applied_or_dropped() -> None:
    text = ("\x1b]0;a title\x07\x1b[1;32mgreen\x1b[0m text\n"  # OSC title and colours: dropped
            "\rdownloading 10%\r\x1b[2Kdownloading 100%\n"  # a redraw that erases first (rich, pip)
            "abcdef\x1b[3D\x1b[Kxy\n"  # back 3 columns, erase to the end
            "tab\tand\bD\n"  # a tab is kept, a backspace moves back
            "\x1b[\x1b[?25lhidden cursor\n")  # not a sequence (ESC [ ESC) and a mode change
    assert rendered(text) == ["green text", "downloading 100%", "abcxy", "tab\tanD", "hidden cursor"]
    assert rendered(text, 1) == rendered(text)
    assert rendered("\x1b]never ended\n" + "x" * MAX_OSC + "\n") == ["never ended", "x" * MAX_OSC]


def test_lines_pass_through_and_a_last_line_without_newline_is_shown_at_the_end() -> None:
    screen = Screen()
    assert screen.feed("a\n\nb ") == ["a", ""]
    assert screen.feed("c\r\nd") == ["b c"]  # CR LF ends a line like LF
    assert screen.close() == ["d"]
    assert rendered("\r" + "bar 10%\r" + "bar 20%") == ["bar 20%"]


def test_a_bar_left_on_its_row_shows_when_a_line_below_it_does() -> None:
    screen = Screen()
    assert screen.feed("\rbar 1/2\rbar 2/2\n") == []  # it may still be redrawn (tqdm comes back to it)
    assert screen.feed("next\n") == ["bar 2/2", "next"]
    many = "".join(f"\rbar {i} 0%\rbar {i} 100%\n" for i in range(MAX_ROWS + 3))
    assert screen.feed(many) == [f"bar {i} 100%" for i in range(3)]  # at most MAX_ROWS held
    assert screen.close() == [f"bar {i} 100%" for i in range(3, MAX_ROWS + 3)]


def test_lightnings_chatter_and_python_warnings_show_once_per_launch() -> None:
    warning = ("/venv/lightning/pytorch/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated, "
               "use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead.")
    future = "/venv/torch/nn/modules/module.py:1750: FutureWarning: something changes"
    per_host = {h: ["GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
                    "💡 Tip: For seamless cloud uploads and versioning, try installing litmodels",
                    warning, future, "  warnings.warn(", f"nodeox: host {h} round 0, step 10",
                    "`Trainer.fit` stopped: `max_steps=40` reached.", "Epoch 1: 100%|##| 2/2", "done"]
                for h in (0, 1)}
    out = io.StringIO()
    console = Console(out)
    sources = {h: object() for h in (0, 1)}
    for i in range(len(per_host[0])):
        for h in (1, 0):  # host 1 first: the first to print a line shows it
            console.line(sources[h], f"[host {h}]", per_host[h][i])
    lines = out.getvalue().splitlines()
    once = per_host[1][:6] + ["`Trainer.fit` stopped: `max_steps=40` reached."]
    assert [f"[host 1] {line}" for line in once] == [line for line in lines if not line.endswith(
        ("round 0, step 10", "2/2", "done"))]
    for h in (0, 1):  # every other line from every host
        assert [line for line in lines if line.startswith(f"[host {h}]") and line.endswith(
            ("step 10", "2/2", "done"))] == [f"[host {h}] nodeox: host {h} round 0, step 10",
                                              f"[host {h}] Epoch 1: 100%|##| 2/2", f"[host {h}] done"]


def test_an_indented_line_is_dropped_only_under_a_dropped_warning() -> None:
    once = OncePerLaunch()
    a, b = object(), object()
    warning = "/x/y.py:3: UserWarning: careful"
    assert once.shown(a, warning) and once.shown(a, "  warnings.warn(")  # the first: shown with its source line
    assert not once.shown(b, warning) and not once.shown(b, "  warnings.warn(")
    assert once.shown(b, "  an indented line of the host's own")  # not under a dropped warning any more
    assert once.shown(a, "  warnings.warn(")


def test_a_childs_stream_is_read_whole_and_prefixed() -> None:
    out = io.StringIO()
    Console(out).follow("[host 0]", io.BufferedReader(io.BytesIO("é\x1b[1mbold\x1b[0m\nb \xff\n".encode()[:-3]
                                                                   + b"\xff\xfe\n")))
    assert out.getvalue().splitlines() == ["[host 0] ébold", "[host 0] b \ufffd\ufffd"]

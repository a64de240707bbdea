"""`nodeox launch`'s output: one prefixed line per line a host writes, a progress bar shown as it ends."""

from __future__ import annotations

import io

from lightning_nodeox.tools.launch import _exit_status, _stream


def streamed(data: bytes) -> list[str]:
    out = io.StringIO()
    _stream("[host 0]", io.BufferedReader(io.BytesIO(data)), out)
    return out.getvalue().splitlines()


def test_a_progress_bar_shows_its_last_state_not_every_refresh() -> None:
    bar = b"".join(b"\rEpoch 0: %3d%%|" % p for p in range(0, 101, 5))
    tqdm_write = b"\r" + b" " * 20 + b"\rnodeox: host 0 round 1, step 20\n"  # tqdm.write clears the bar first
    lines = streamed(b"GPU available: False\n" + bar + tqdm_write + bar + b"\n" + b"done\r\n" + b"tail")
    assert lines == ["[host 0] GPU available: False", "[host 0] nodeox: host 0 round 1, step 20",
                     "[host 0] Epoch 0: 100%|", "[host 0] done", "[host 0] tail"]


def test_blank_lines_and_broken_utf8_pass_through() -> None:
    assert streamed(b"a\n\nb \xff\xfe\n") == ["[host 0] a", "[host 0] ", "[host 0] b \ufffd\ufffd"]


def test_exit_status_names_the_signal() -> None:
    assert _exit_status(143) == "exit status 143 (SIGTERM)"
    assert _exit_status(-9) == "exit status -9 (SIGKILL)"
    assert _exit_status(1) == "exit status 1"

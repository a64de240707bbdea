"""What a terminal would show of a child's output stream, as whole lines, for ``nodeox launch`` to prefix.

The stream is played on a small screen: carriage returns, backspaces, cursor moves (``ESC[nA`` up, ``ESC[nB``
down, ``ESC[nC``/``ESC[nD``/``ESC[nG`` along the row) and erases (``ESC[K``, ``ESC[1K``, ``ESC[2K``) act as they
would on a terminal; every other escape sequence (colours, OSC titles) and control character is dropped, so no
escape character reaches the lines shown.

A row is shown once the cursor leaves it with a newline, unless the row is being redrawn: a row whose content was
overwritten or erased (a progress bar) is held, since the cursor may come back to it (tqdm's nested validation
bar steps a row down and back up at every refresh), and is shown, in its last state, when a row below it is shown,
when the stream ends, or once it is ``MAX_ROWS`` rows above the cursor. A bar's intermediate states are never
shown; a bar cleared for good (tqdm's ``leave=False``) shows nothing. A row cleared and then written again
starts afresh (``tqdm.write`` clears the bar's row and writes its line there).
"""

from __future__ import annotations

import re

MAX_ROWS = 8  # rows held below the last row shown: tqdm's nested bars take one each
MAX_OSC = 4096  # characters an OSC sequence may take before it is taken for text
_CSI = re.compile(r"\[([0-?]*)[ -/]*")  # after ESC: parameters and intermediates; then the final character
_OSC_END = re.compile(r"\x07|\x1b\\")
_PLAIN = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]+")  # shown characters (a tab among them)


class _Row:
    """A row's characters, how many are not spaces, and whether it is being redrawn."""

    __slots__ = ("chars", "filled", "redrawn")

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.filled = 0
        self.redrawn = False

    def put(self, col: int, ch: str) -> None:
        chars = self.chars
        if col >= len(chars):
            chars.extend(" " * (col + 1 - len(chars)))
        old = chars[col]
        if ch != " ":
            if self.filled == 0:
                self.redrawn = False  # written again after it was cleared: a row of its own
            elif old != " ":
                self.redrawn = True
        chars[col] = ch
        self.filled += (ch != " ") - (old != " ")

    def write(self, col: int, text: str) -> None:
        """``text`` (shown characters) from column ``col`` on."""
        if col != len(self.chars):
            for i, ch in enumerate(text):
                self.put(col + i, ch)
            return
        filled = len(text) - text.count(" ")  # appended at the end: nothing overwritten
        if filled and self.filled == 0:
            self.redrawn = False
        self.chars.extend(text)
        self.filled += filled

    def erase(self, start: int, end: int) -> None:
        cut = self.chars[start:end]
        gone = sum(c != " " for c in cut)
        if gone:
            self.redrawn = True
            self.chars[start:end] = " " * len(cut)
            self.filled -= gone

    def text(self) -> str:
        return "".join(self.chars).rstrip()


class Screen:
    """Feed it the stream's text as it comes; it returns the lines a terminal would have settled on."""

    def __init__(self) -> None:
        self._rows = [_Row()]  # the first row not yet shown, and those below it
        self._row = 0  # the cursor
        self._col = 0
        self._partial = ""  # an escape sequence cut off at the end of the last text fed

    def feed(self, text: str) -> list[str]:
        """The lines the screen settles on with ``text``."""
        out: list[str] = []
        text, self._partial = self._partial + text, ""
        i, n = 0, len(text)
        while i < n:
            ch = text[i]
            if ch == "\x1b":
                end = self._escape(text, i)
                if end is None:
                    self._partial = text[i:]
                    break
                i = end
                continue
            if ch == "\n":
                self._newline(out)
            elif ch == "\r":
                self._col = 0
            elif ch == "\b":
                self._col = max(0, self._col - 1)
            elif ch == "\t" or ch >= " " and ch != "\x7f":
                run = _PLAIN.match(text, i).group()
                self._rows[self._row].write(self._col, run)
                self._col += len(run)
                i += len(run)
                continue
            i += 1
        return out

    def close(self) -> list[str]:
        """At the end of the stream: what is still on the screen (a bar's last state, a last line without newline)."""
        rows, self._rows, self._row, self._col, self._partial = self._rows, [_Row()], 0, 0, ""
        while rows and not rows[-1].chars:  # the row after the last newline, never written
            rows.pop()
        return [line for line in map(_shown, rows) if line is not None]

    def _newline(self, out: list[str]) -> None:
        rows, row = self._rows, self._row
        if not rows[row].redrawn:
            out += [line for line in map(_shown, rows[: row + 1]) if line is not None]
            del rows[: row + 1]
            row = -1
        elif row >= MAX_ROWS:
            line = _shown(rows.pop(0))
            if line is not None:
                out.append(line)
            row -= 1
        self._row, self._col = row + 1, 0
        if self._row == len(rows):
            rows.append(_Row())

    def _escape(self, text: str, i: int) -> int | None:
        """Act on the escape sequence at ``text[i]``; where it ends, or None if ``text`` ends inside it."""
        if i + 1 >= len(text):
            return None
        kind = text[i + 1]
        if kind == "[":
            m = _CSI.match(text, i + 1)
            end = m.end()
            if end == len(text):
                return None
            if "@" <= text[end] <= "~":
                self._csi(m.group(1), text[end])
                return end + 1
            return i + 2  # not a sequence after all: ESC [ is dropped, the rest shown
        if kind == "]":  # OSC (a window title, a hyperlink): dropped up to its terminator
            m = _OSC_END.search(text, i + 2)
            if m is None:
                return None if len(text) - i < MAX_OSC else i + 2  # never ended: ESC ] dropped, the rest shown
            return m.end()
        return i + 2  # a two-character sequence (ESC 7, ESC M, ...): dropped

    def _csi(self, params: str, final: str) -> None:
        numbers = [int(p) if p.isdigit() else 0 for p in params.split(";")] if params else [0]
        n = max(1, numbers[0])
        rows = self._rows
        if final == "A":
            self._row = max(0, self._row - n)  # rows already shown cannot be reached again
        elif final == "B":
            self._row += n
            rows.extend(_Row() for _ in range(self._row + 1 - len(rows)))
        elif final == "C":
            self._col += n
        elif final == "D":
            self._col = max(0, self._col - n)
        elif final == "G":
            self._col = n - 1
        elif final == "K":
            row = rows[self._row]
            start, end = {0: (self._col, len(row.chars)), 1: (0, self._col + 1)}.get(numbers[0], (0, len(row.chars)))
            row.erase(start, end)
        # every other sequence (colours and other attributes, scrolling, modes) changes nothing shown here


def _shown(row: _Row) -> str | None:
    """A row's line, or None for a bar that was cleared (an empty row that was never redrawn is an empty line)."""
    text = row.text()
    return None if not text and row.redrawn else text

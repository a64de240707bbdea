"""README's command list names every flag each ``nodeox`` subcommand's ``--help`` shows, so the two cannot drift."""

from __future__ import annotations

import argparse
import re

from helpers import REPO

from lightning_nodeox.tools.cli import _launch_options, _parser


def command_lines() -> dict[str, str]:
    """README's bullet of each ``nodeox NAME`` command under "## Commands"."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Commands") : text.index("## Documentation")]
    bullets = re.split(r"\n- (?=`nodeox )", section)
    return {re.match(r"`nodeox (\w+)", b).group(1): b for b in bullets if b.startswith("`nodeox ")}


def shown_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def test_every_flag_that_help_shows_is_in_its_command_line_in_the_readme() -> None:
    subcommands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    lines = command_lines()
    assert set(lines) == set(subcommands)
    launch_own = argparse.ArgumentParser(add_help=False)
    _launch_options(launch_own)
    for name, parser in subcommands.items():
        flags = shown_flags(launch_own) if name == "launch" else shown_flags(parser)  # launch: "[coordinator options]"
        missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", lines[name]))
        assert missing == [], f"README's nodeox {name} line lacks {missing}"
    assert "[coordinator options]" in lines["launch"]

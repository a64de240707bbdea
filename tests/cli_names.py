"""What the deploy files (deploy/kubernetes, deploy/slurm) may name: the ``NODEOX_*`` variables the code reads
(``ENV_*`` of core/settings.py) and the flags of each ``nodeox`` command, from the real parser."""

from __future__ import annotations

import argparse

from lightning_nodeox.core import settings
from lightning_nodeox.tools.cli import _parser

NODEOX_VARIABLES = frozenset(value for name, value in vars(settings).items() if name.startswith("ENV_"))


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Each ``nodeox`` command's parser, by name."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def unknown_flags(argv: list[str]) -> list[str]:
    """The flags of ``nodeox ARGV`` (ARGV[0]: the command) that its parser does not have."""
    known = subcommands()[argv[0]]._option_string_actions
    return [word.split("=", 1)[0] for word in argv[1:] if word.startswith("--") and word.split("=", 1)[0] not in known]

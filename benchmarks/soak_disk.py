"""A small disk the soak can fill: a tmpfs mounted for the root coordinator's run directory.

``Disk.mount(path, size)`` mounts a tmpfs of ``size`` bytes on ``path`` (root only; None where it cannot, with why
in ``Disk.unavailable``); ``fill()`` takes every free byte with a ballast file, ``free()`` deletes it, ``unmount()``
unmounts (after the run's records have been read).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

CHUNK = 1 << 20


class Disk:
    """A mounted tmpfs with a ballast file to fill it."""

    unavailable = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ballast = path / "ballast"

    @classmethod
    def mount(cls, path: Path, size: int) -> Disk | None:
        """A tmpfs of ``size`` bytes on ``path``; None (and ``Disk.unavailable`` says why) where mount fails."""
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            cls.unavailable = f"cannot mount a tmpfs on {path}: {done.stderr.strip() or done.returncode}"
            return None
        return cls(path)

    def fill(self) -> int:
        """Take every free byte; returns how many the ballast holds."""
        written, size = 0, CHUNK
        block = b"\0" * CHUNK
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            while size:
                try:
                    written += os.write(fd, block[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    size //= 2  # the last bytes, in ever smaller writes
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        self.free()
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)

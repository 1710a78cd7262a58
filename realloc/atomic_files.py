"""Files written whole or not at all, and the check that one can be written, before any work.

The files this project writes for its users (rank files and manifests, HF exports, traces, plan
pictures, the shipped dashboard) go through :func:`atomic_write`: a temporary file in the same folder,
fsynced, renamed into place, the folder entry fsynced; readers see the old file or the whole new
one, and a failure leaves the old one as it was and no temporary file behind. Pure: no torch.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

#: Name prefix of the temporary files (a crashed writer's leftovers are recognised by it).
TEMP_PREFIX = ".tmp-"


def atomic_write(path: "str | os.PathLike", data: "bytes | memoryview") -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part
    (the new file gets the usual permissions of the process's umask)."""
    path = Path(path)
    tmp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable, where the filesystem allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_output_file(path: "str | os.PathLike", what: str) -> Path:
    """``path`` as a :class:`Path` if :func:`atomic_write` can write there (a file name in a folder
    that exists and is writable), else ``ValueError`` saying why; ``what`` names it (``"--svg"``).

    >>> check_output_file("/", "--trace")
    Traceback (most recent call last):
    ...
    ValueError: --trace '/' is a directory; give a file name
    >>> check_output_file(None, "trace path")
    Traceback (most recent call last):
    ...
    ValueError: trace path must be a file path (a str or os.PathLike), got None
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise ValueError(f"{what} must be a file path (a str or os.PathLike), got {path!r}"[:200])
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a directory; give a file name")
    if not p.parent.is_dir():
        raise ValueError(f"{what} {str(path)!r}: directory {str(p.parent)!r} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise ValueError(f"{what} {str(path)!r}: directory {str(p.parent)!r} is not writable")
    return p

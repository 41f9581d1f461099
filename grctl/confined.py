"""Files a request names, opened so that a symlink cannot carry the server outside its root.

A route checks a path against --weights-root; the worker opens the file later, by name, and a
symlink swapped in between would be followed. So the check is made again on what was opened:
the descriptor's file must be the one its path resolves to now (same device and inode), and
that resolved path must lie inside the root. Files written as plain files by grctl or the
trainer (delta files and their index, the local checkpoint's marker) are opened with
O_NOFOLLOW: a symlink in their place is refused, never read or written through. A file is
written by a temporary of a random name created with O_EXCL|O_NOFOLLOW (tempfile.mkstemp),
fsynced, then renamed over the name (a rename replaces a symlink, it never follows one).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from grctl.errors import Forbidden, ValidationError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def is_inside(path: str | Path, root: str | Path) -> bool:
    """`path` (already resolved) is `root` itself or lies under it (resolved here)."""
    path, root = Path(path), Path(root).resolve()
    return path == root or root in path.parents


def open_read(path: str | Path, *, root: str | Path | None, what: str, follow: bool) -> int:
    """A descriptor on the regular file at `path`, checked through the descriptor: inside
    `root` when one is given. With follow=False a symlink at `path` is refused (a 400).
    Raises OSError as os.open does for a missing or unreadable file."""
    try:
        fd = os.open(path, READ_FLAGS | (0 if follow else NOFOLLOW))
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise ValidationError(
                f"{what} {str(path)!r} is a symlink: it is read only as a plain file",
                hint="publish the file itself in the directory, not a link to it",
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValidationError(f"{what} {str(path)!r} is not a regular file")
        if root is not None:
            check_inside(fd, st, path, root, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_inside(fd: int, st: os.stat_result, path: str | Path, root: str | Path, what: str):
    """The file open on `fd` is the one `path` resolves to now, and that lies inside `root`."""
    real = os.path.realpath(path)
    try:
        now = os.stat(real)
    except OSError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise Forbidden(
            f"{what} {str(path)!r} changed while it was opened",
            hint="write files under --weights-root in place before naming them",
        )
    if not is_inside(real, root):
        raise Forbidden(
            f"{what} {str(path)!r} resolves outside the weights root",
            hint=f"files may only be read under {str(Path(root).resolve())!r} (--weights-root)",
        )


def fd_path(fd: int, fallback: str | Path) -> str:
    """A name that opens the very file `fd` is on (for libraries that open by name, such as
    safetensors' safe_open): /proc/self/fd/N on Linux, /dev/fd/N elsewhere, else `fallback`."""
    for base in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(base):
            return f"{base}/{fd}"
    return str(fallback)


@contextmanager
def opened(path: str | Path, *, root: str | Path | None, what: str, follow: bool) -> Iterator[str]:
    """`open_read`, yielding a name of the open file (fd_path) for the block; closed after."""
    fd = open_read(path, root=root, what=what, follow=follow)
    try:
        yield fd_path(fd, path)
    finally:
        os.close(fd)


def read_bytes(path: str | Path, *, root: str | Path | None, what: str, limit: int) -> bytes:
    """The whole plain file at `path` (O_NOFOLLOW, checked through its descriptor), refused
    (a 400) when it is over `limit` bytes."""
    fd = open_read(path, root=root, what=what, follow=False)
    with open(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValidationError(f"{what} {str(path)!r} is over {limit} bytes")
        return f.read(limit + 1)


def make_temp(directory: str | Path, prefix: str, suffix: str = "") -> tuple[int, Path]:
    """A new file of a random name in `directory` (O_EXCL|O_NOFOLLOW, mode 0600): a name
    nobody could plant a symlink at beforehand."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    return fd, Path(name)


def write_file(path: Path, data: bytes) -> None:
    """Replace `path` with a file holding `data`, durably: a temporary beside it, fsynced,
    renamed over `path` (a symlink there is replaced, not written through), the dir fsynced."""
    fd, tmp = make_temp(path.parent, f".{path.name}.", ".tmp")
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable; a no-op where a
    directory cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory
    finally:
        os.close(fd)

"""A host-local checkpoint that delta versions patch on disk (miles' `local_checkpoint_dir`).

miles' disk-delta flow: `/pull_weights` with `target_version` 0 materialises the engine's base
checkpoint in `local_checkpoint_dir`; each later pull applies the published versions onto that
directory's files, and miles then reloads the directory with `/update_weights_from_disk`. The
pull itself writes no served weight.

The directory is crash-consistent: after a kill at any point it is wholly one version, and the
same pull works again. `local_checkpoint_dir` is a symlink to a version directory beside it:

    PARENT/NAME -> .NAME.v000003-k2j9x0ab      swapped by one rename of a new symlink
    PARENT/.NAME.v000003-k2j9x0ab/             the files, and the marker MARK ("3")

A version is built whole in a new directory of a random name (tempfile.mkdtemp): the changed
files written there, the unchanged ones hard-linked from the current version; every file, the
marker and the directory are fsynced before the symlink is swapped, and the previous version is
removed after. Each version's base must be the marker's and every tensor's new bytes must match
its checksum (delta.decoded) before anything is built. Each pull, under a lock on the parent
directory (one pull at a time, across processes), first removes what a killed pull left beside
it: every `.NAME.*` entry but the current version (a directory moved aside before its symlink
landed is put back). A directory seeded by an older grctl (a plain directory) is moved aside
when its first version is swapped in.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from grctl import confined
from grctl.errors import Conflict, GrctlError, ValidationError
from grctl.weights import delta

MARK = ".grctl-local-version"
_lock = threading.Lock()  # one pull at a time in this process (the parent's flock: across them)
# test-only (grctl/testing/faults.py): called with each step of a build and swap
# ("file_written", "built", "swapped")
hooks: list[Callable[[str], None]] = []


def local_version(local: Path) -> int | None:
    """The version the directory holds (its marker, never read through a symlink)."""
    try:
        return int(confined.read_bytes(local / MARK, root=None, what="marker", limit=64))
    except (OSError, ValueError, GrctlError):
        return None


def pull(
    local: Path, source_dir: Path, target: int, base_dir: Path, *, root: Path | None = None
) -> tuple[int, int]:
    """Bring `local` to version `target`. Returns (versions applied, tensors written)."""
    a, b, c = local.resolve(), base_dir.resolve(), source_dir.resolve()
    for other, what in ((b, "the served checkpoint"), (c, "source_dir")):
        if a == other or a in other.parents or other in a.parents:
            raise ValidationError(
                f"local_checkpoint_dir {str(local)!r} overlaps {what} {str(other)!r}",
                hint="name a directory of its own (miles: --update-weight-local-checkpoint-dir)",
            )
    if target == 0:
        local.parent.mkdir(parents=True, exist_ok=True)
    with _lock, _parent_locked(local):
        _clean(local)
        if target == 0:
            _swap(local, _seeded(local, base_dir))
            return 0, 0
        cur_dir = _current(local)
        cur = None if cur_dir is None else local_version(cur_dir)
        if cur is None:
            raise Conflict(
                f"local_checkpoint_dir {str(local)!r} holds no seeded checkpoint",
                hint="pull target_version 0 first (it copies the base checkpoint there)",
            )
        if cur > target:
            raise Conflict(
                f"local_checkpoint_dir is at version {cur}, past target_version {target}",
                hint="seed it again with target_version 0, then pull forward",
            )
        written = 0
        for v in range(cur + 1, target + 1):
            build, n = _built(local, cur_dir, delta.version_dir(source_dir, v), v, root)
            _swap(local, build)
            cur_dir, written = build, written + n
        return target - cur, written


@contextmanager
def _parent_locked(local: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the thread lock only
        yield
        return
    try:
        fd = os.open(local.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # no parent: nothing to clean, nothing seeded
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _ours(local: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(local.name)}\.(v\d{{6}}|link|old|seed)-[a-z0-9_]+")


def _current(local: Path) -> Path | None:
    """The version directory `local` is now: the one its symlink names, or `local` itself
    when an older grctl seeded it as a plain directory (it has a marker); None otherwise."""
    if local.is_symlink():
        target = os.readlink(local)
        ours = _ours(local).fullmatch(target) and target.startswith(f".{local.name}.v")
        return local.parent / target if ours and (local.parent / target).is_dir() else None
    return local if local.is_dir() and local_version(local) is not None else None


def _clean(local: Path) -> None:
    """Remove what a killed pull left beside `local`: a directory moved aside before its
    symlink landed goes back; every other `.NAME.*` entry but the current version goes."""
    if not local.parent.is_dir():
        return
    ours = _ours(local)
    left = sorted(p for p in local.parent.iterdir() if ours.fullmatch(p.name))
    if not os.path.lexists(local):
        aside = [p for p in left if p.name.startswith(f".{local.name}.old-")]
        if aside:
            os.rename(aside[0], local)
            confined.fsync_dir(local.parent)
    keep = _current(local)
    for p in left:
        if p == keep or not os.path.lexists(p):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _new_version_dir(local: Path, version: int) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{local.name}.v{version:06d}-", dir=local.parent))


def _seeded(local: Path, base_dir: Path) -> Path:
    """Version 0 built beside `local`: a copy of the engine's base checkpoint."""
    if not (base_dir / "config.json").is_file():
        raise ValidationError(
            f"the served model {str(base_dir)!r} is not a checkpoint directory to seed from",
            hint="start the server with --model-path DIR to use local_checkpoint_dir",
        )
    empty = local.is_dir() and not local.is_symlink() and not any(local.iterdir())
    if os.path.lexists(local) and _current(local) is None and not empty:
        raise Conflict(
            f"local_checkpoint_dir {str(local)!r} exists and is not a local checkpoint grctl "
            "seeded: it is left as it is",
            hint="name a new or empty directory (a seed replaces the directory's contents)",
        )
    build = _new_version_dir(local, 0)
    try:
        shutil.copytree(base_dir, build, dirs_exist_ok=True)
        _finish(build, 0)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return build


def _built(local: Path, cur_dir: Path, vdir: Path, version: int, root) -> tuple[Path, int]:
    """Version `version` built beside `local` from the current one: (its directory, tensors
    written). Everything is decoded and checked before the directory is made."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cur = version - 1
    index = delta.read_index(vdir, root)
    meta = index["metadata"]
    if not delta.same_version(meta.get("base_version"), cur):
        raise Conflict(
            f"the delta's base is version {meta.get('base_version')!r}; local_checkpoint_dir "
            f"is at {cur}",
            hint="publish deltas in sequence, or seed again with target_version 0",
        )
    where: dict[str, Path] = {}
    for f in sorted(cur_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))
    algorithm, enc = str(meta.get("checksum_format")), meta["delta_encoding"]

    def decode(st, sums, name: str) -> torch.Tensor:
        if name not in where:
            raise ValidationError(f"delta names {name!r}: not a tensor of the local checkpoint")
        with safe_open(str(where[name]), framework="pt") as ck:
            cur_t = ck.get_tensor(name)
        base = cur_t.contiguous().view(torch.uint8).reshape(-1).numpy()
        out = delta.decoded(st, sums, name, enc, algorithm, meta, base, cur_t.element_size())
        return torch.from_numpy(out.copy()).view(cur_t.dtype).reshape(cur_t.shape)

    new_by_file: dict[Path, dict[str, torch.Tensor]] = {}
    for name, t in delta.each_tensor(vdir, index, decode, root).items():
        new_by_file.setdefault(where[name], {})[name] = t
    rewritten = {f.name for f in new_by_file}

    def skipped(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == cur_dir
        return {n for n in names if n.startswith(".") or (top and n in rewritten)}

    build = _new_version_dir(local, version)
    try:  # unchanged files are shared (hard links: no file is ever written in place)
        shutil.copytree(cur_dir, build, ignore=skipped, copy_function=_link, dirs_exist_ok=True)
        for f, changed in new_by_file.items():
            with safe_open(str(f), framework="pt") as ck:
                file_meta = ck.metadata()
            tensors = load_file(str(f))
            tensors.update(changed)
            save_file(tensors, str(build / f.name), metadata=file_meta)
            confined.fsync_file(build / f.name)
            for hook in hooks:
                hook("file_written")
        _finish(build, version)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return build, sum(len(c) for c in new_by_file.values())


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)
        confined.fsync_file(Path(dst))


def _finish(build: Path, version: int) -> None:
    """Make a built version durable: every file and directory fsynced, then the marker."""
    for d, _, files in os.walk(build):
        for f in files:
            confined.fsync_file(Path(d) / f)
        confined.fsync_dir(Path(d))
    confined.write_file(build / MARK, str(version).encode())
    os.chmod(build, 0o755)  # mkdtemp's 0700, now that it is whole: readable as a copy is
    for hook in hooks:
        hook("built")


def _swap(local: Path, build: Path) -> None:
    """Point `local` at `build` with one rename, then remove the version it named."""
    old = _current(local)
    token = secrets.token_hex(4)
    if os.path.lexists(local) and not local.is_symlink():  # a plain dir: moved aside first
        old = local.with_name(f".{local.name}.old-{token}")
        os.rename(local, old)
    link = local.with_name(f".{local.name}.link-{token}")
    os.symlink(build.name, link)
    os.replace(link, local)
    confined.fsync_dir(local.parent)
    for hook in hooks:
        hook("swapped")
    if old is not None and old != build:
        shutil.rmtree(old, ignore_errors=True)

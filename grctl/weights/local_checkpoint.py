"""A host-local checkpoint that delta versions patch on disk (miles' `local_checkpoint_dir`).

miles' disk-delta flow: `/pull_weights` with `target_version` 0 materialises the engine's base
checkpoint in `local_checkpoint_dir`; each later pull applies the published versions onto that
directory's files, and miles then reloads the directory with `/update_weights_from_disk`. The
pull itself writes no served weight.

The directory's version is kept in a marker file (MARK). A pull to version N applies each
version after the marker's up to N in turn; each version's base must be the marker's and every
tensor's new bytes must match its checksum (delta.decoded) before any file is written. A
changed safetensors file is written whole under a temporary name and renamed over the old one,
then the marker moves on: a reader sees the old or the new file, never a half-written one.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

from grctl.errors import Conflict, ValidationError
from grctl.weights import delta

MARK = ".grctl-local-version"
_lock = threading.Lock()  # one pull at a time patches a directory


def local_version(local: Path) -> int | None:
    try:
        return int((local / MARK).read_text().strip())
    except (OSError, ValueError):
        return None


def seed(local: Path, base_dir: Path) -> int:
    """Version 0: a copy of the engine's base checkpoint (replacing what the dir held).
    Returns the number of files copied."""
    if not (base_dir / "config.json").is_file():
        raise ValidationError(
            f"the served model {str(base_dir)!r} is not a checkpoint directory to seed from",
            hint="start the server with --model-path DIR to use local_checkpoint_dir",
        )
    if local.exists() and (
        not local.is_dir() or (any(local.iterdir()) and local_version(local) is None)
    ):
        raise Conflict(
            f"local_checkpoint_dir {str(local)!r} exists and is not a local checkpoint grctl "
            "seeded: it is left as it is",
            hint="name a new or empty directory (a seed replaces the directory's contents)",
        )
    tmp = local.with_name(f".{local.name}.seed-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base_dir, tmp)
    (tmp / MARK).write_text("0")
    if local.exists():
        old = local.with_name(f".{local.name}.old-{os.getpid()}")
        os.replace(local, old)
        os.replace(tmp, local)
        shutil.rmtree(old, ignore_errors=True)
    else:
        local.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, local)
    return sum(1 for _ in local.iterdir()) - 1


def pull(local: Path, source_dir: Path, target: int, base_dir: Path) -> tuple[int, int]:
    """Bring `local` to version `target`. Returns (versions applied, tensors written)."""
    a, b, c = local.resolve(), base_dir.resolve(), source_dir.resolve()
    for other, what in ((b, "the served checkpoint"), (c, "source_dir")):
        if a == other or a in other.parents or other in a.parents:
            raise ValidationError(
                f"local_checkpoint_dir {str(local)!r} overlaps {what} {str(other)!r}",
                hint="name a directory of its own (miles: --update-weight-local-checkpoint-dir)",
            )
    with _lock:
        if target == 0:
            seed(local, base_dir)
            return 0, 0
        cur = local_version(local)
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
            written += _apply_version(local, delta.version_dir(source_dir, v), cur=v - 1)
            (local / MARK).write_text(str(v))
        return target - cur, written


def _apply_version(local: Path, vdir: Path, *, cur: int) -> int:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    index = delta.read_index(vdir)
    meta = index["metadata"]
    if not delta.same_version(meta.get("base_version"), cur):
        raise Conflict(
            f"the delta's base is version {meta.get('base_version')!r}; local_checkpoint_dir "
            f"is at {cur}",
            hint="publish deltas in sequence, or seed again with target_version 0",
        )
    where: dict[str, Path] = {}
    for f in sorted(local.glob("*.safetensors")):
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
    for name, t in delta.each_tensor(vdir, index, decode).items():
        new_by_file.setdefault(where[name], {})[name] = t
    staged: list[tuple[Path, Path]] = []
    try:
        for f, changed in new_by_file.items():
            with safe_open(str(f), framework="pt") as ck:
                file_meta = ck.metadata()
            tensors = load_file(str(f))
            tensors.update(changed)
            tmp = f.with_name(f".{f.name}.tmp-{os.getpid()}")
            save_file(tensors, str(tmp), metadata=file_meta)
            staged.append((tmp, f))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, f in staged:
        os.replace(tmp, f)
    return sum(len(c) for c in new_by_file.values())

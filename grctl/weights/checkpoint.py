"""The checkpoint source: an HF directory read lazily, validated from headers before any copy.

Layouts: model.safetensors; shards listed by model.safetensors.index.json; pytorch_model.bin
(or its shard index) and *.pt, loaded whole with weights_only=True (peak memory: the file).
safetensors files are opened with `safe_open`, which checks that each file is as long as its
header's offsets say, so a truncated file is refused at validation, before the first byte is
copied. Their tensors are then read with pread through a descriptor opened, and stamped (inode,
size, mtime), before `safe_open` reads the header, never through a memory map: a file truncated
after validation gives a short read (an OSError, so the update fails and the tensors it began
are torn) where a mapped read would kill the server with SIGBUS; a file renamed over it is not
seen; one rewritten in place is noticed by its size and mtime, by the check at the end of
validation (a 400, nothing written) or by the one after each read."""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from grctl import confined
from grctl.errors import Forbidden, GrctlError, ValidationError, WeightValidationError
from grctl.model.config import ModelConfig
from grctl.model.dtypes import SAFETENSORS
from grctl.weights import apply
from grctl.weights.apply import TensorSpec

# Called with the checkpoint before each tensor is read. Empty in production; tests install a
# fault here (grctl.testing.faults).
read_hooks: list[Callable[[Checkpoint], None]] = []


class Checkpoint:
    """One checkpoint directory. `specs()` reads headers only; `fetch(name)` reads one tensor."""

    def __init__(self, path: str | Path, *, root: str | Path | None = None):
        """`root` (--weights-root): every weight file opened must lie inside it, checked
        through its descriptor (confined.py), wherever the path's symlinks lead."""
        self.root = root
        if "\x00" in str(path):
            raise WeightValidationError("checkpoint path contains a NUL byte")
        self.path = Path(path)
        if not self.path.exists():
            raise WeightValidationError(f"checkpoint path {str(self.path)!r} does not exist")
        if not self.path.is_dir():
            raise WeightValidationError(f"checkpoint path {str(self.path)!r} is not a directory")
        try:
            self.config = ModelConfig.from_hf(self.path / "config.json")
        except ValidationError as exc:
            raise WeightValidationError(exc.message) from exc
        self.files = self._weight_files()
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._readers: dict[Path, PinnedSafetensors] = {}
        self._torch_state: dict[Path, dict[str, torch.Tensor]] = {}

    def _weight_files(self) -> list[Path]:
        p = self.path
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = p / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise WeightValidationError(f"cannot read {index}: {exc}") from exc
                files = []
                for shard in dict.fromkeys(weight_map.values()):
                    shard_path = (p / str(shard)).resolve()
                    if shard_path.parent != p.resolve():
                        raise WeightValidationError(
                            f"{index_name} names a shard outside the checkpoint: {shard!r}"
                        )
                    if not shard_path.is_file():
                        raise WeightValidationError(f"shard {shard!r} listed in {index} is missing")
                    files.append(shard_path)
                return files
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (p / single).is_file():
                return [p / single]
        found = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.pt"))
        if not found:
            raise WeightValidationError(
                f"no weights in {str(p)!r}: expected model.safetensors, shards with "
                "model.safetensors.index.json, pytorch_model.bin or *.pt"
            )
        return found

    def specs(self) -> list[TensorSpec]:
        """Every tensor's name, shape and dtype, from the file headers alone."""
        specs: list[TensorSpec] = []
        for file in self.files:
            if file.suffix == ".safetensors":
                handle = self._open(file)
                for name in handle.keys():
                    sl = handle.get_slice(name)
                    dtype = SAFETENSORS.get(sl.get_dtype())
                    if dtype is None:
                        raise WeightValidationError(
                            f"tensor {name!r} in {file.name} has unsupported dtype {sl.get_dtype()}"
                        )
                    specs.append(TensorSpec(name, tuple(sl.get_shape()), dtype))
                    self._where[name] = file
            else:
                for name, t in self._torch_file(file).items():
                    specs.append(TensorSpec(name, tuple(t.shape), t.dtype))
                    self._where[name] = file
        return specs

    def fetch(self, name: str) -> torch.Tensor:
        for hook in read_hooks:
            hook(self)
        file = self._where[name]
        if file.suffix == ".safetensors":
            self._open(file)
            return self._readers[file].read(name)
        return self._torch_file(file)[name]

    def read_into(self, name: str, dst: torch.Tensor) -> bool:
        """Read a tensor straight into `dst` when it needs no conversion; False: use fetch."""
        file = self._where[name]
        if file.suffix != ".safetensors":
            return False
        for hook in read_hooks:
            hook(self)
        self._open(file)
        return self._readers[file].read_into(name, dst)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.specs():
            yield spec.name, self.fetch(spec.name)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._handles.clear()
        self._torch_state.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, file: Path):
        if file not in self._handles:
            reader = None
            try:
                # Stamped first: a change after it, even while safe_open parses, is seen.
                reader = PinnedSafetensors(file)
                if self.root is not None:
                    fd = reader._fh.fileno()
                    confined.check_inside(fd, os.fstat(fd), file, self.root, "checkpoint file")
                handle = safe_open(str(file), framework="pt")  # checks header and length
                reader.index(handle)
                if not reader.is_unchanged(file):
                    raise OSError(errno.ESTALE, "the file changed while being validated")
            except Forbidden:
                reader.close()
                raise
            except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
                if reader is not None:
                    reader.close()
                raise WeightValidationError(
                    f"unreadable safetensors file {file.name}: {exc}"
                ) from exc
            self._handles[file], self._readers[file] = handle, reader
        return self._handles[file]

    def _torch_load_plain(self, file: Path) -> object:
        try:
            fd = confined.open_read(file, root=self.root, what="checkpoint file", follow=True)
            with open(fd, "rb") as f:
                return torch.load(f, map_location="cpu", weights_only=True)
        except GrctlError:
            raise
        except Exception as exc:
            raise WeightValidationError(f"unreadable torch file {file.name}: {exc}") from exc

    def _torch_file(self, file: Path) -> dict[str, torch.Tensor]:
        if file not in self._torch_state:
            # Loaded whole, not mapped: a mapped file truncated after validation would kill the
            # server with SIGBUS at copy time. These legacy formats cost their size in memory.
            state = self._torch_load_plain(file)
            if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                state = state["state_dict"]
            if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
            ):
                raise WeightValidationError(f"{file.name} does not hold a state dict of tensors")
            self._torch_state[file] = state
        return self._torch_state[file]


class PinnedSafetensors:
    """One safetensors file, read with pread through a descriptor opened at validation, before
    its header is parsed, so every byte read is checked against the file as it was then.

    Each tensor's byte range comes from the `safe_open` handle, not from parsing the header
    ourselves: safetensors stores the tensors back to back at the end of the file, with no
    holes (safe_open refuses a file that is not fully covered), in `offset_keys()` order, so a
    tensor's offset is the file size less the data's total size plus the sizes before it.
    """

    def __init__(self, file: Path):
        self.name = file.name
        self._fh = open(file, "rb", buffering=0)  # noqa: SIM115 (closed by close() or GC)
        self._stamp = self._fstat()
        self.ranges: dict[str, tuple[int, int, torch.dtype, list[int]]] = {}

    def _fstat(self) -> tuple[int, int, int, int]:
        st = os.fstat(self._fh.fileno())
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def index(self, handle) -> None:
        """Every tensor's byte range, from the `safe_open` handle of this same file."""
        sizes = []
        for name in handle.offset_keys():
            sl = handle.get_slice(name)
            dtype = SAFETENSORS.get(sl.get_dtype(), torch.uint8)
            shape = list(sl.get_shape())
            nbytes = math.prod(shape) * dtype.itemsize
            sizes.append((name, nbytes, dtype, shape))
        offset = self._stamp[2] - sum(n for _, n, _, _ in sizes)
        for name, nbytes, dtype, shape in sizes:
            self.ranges[name] = (offset, nbytes, dtype, shape)
            offset += nbytes

    def is_unchanged(self, file: Path) -> bool:
        """The path still names the descriptor's file, and it is as it was when stamped."""
        st = os.stat(file)
        return (st.st_dev, st.st_ino) == self._stamp[:2] and self._fstat() == self._stamp

    def read(self, name: str) -> torch.Tensor:
        offset, nbytes, dtype, shape = self.ranges[name]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._read_exact(buf, offset)
        return buf.view(dtype).reshape(shape)

    def read_into(self, name: str, dst: torch.Tensor) -> bool:
        """Read straight into `dst` (a live parameter view) when no conversion is needed."""
        offset, nbytes, dtype, shape = self.ranges[name]
        if dst.device.type != "cpu" or dst.dtype != dtype or not dst.is_contiguous():
            return False
        if list(dst.shape) != shape:
            return False
        self._read_exact(dst.view(-1).view(torch.uint8), offset)
        return True

    def _read_exact(self, out: torch.Tensor, offset: int) -> None:
        pread_exact(self._fh.fileno(), out, offset, f"{self.name} was truncated after validation")
        if self._fstat() != self._stamp:
            raise OSError(errno.ESTALE, f"{self.name} was modified after validation")

    def close(self) -> None:
        self._fh.close()


def pread_exact(fd: int, out: torch.Tensor, offset: int, short: str) -> None:
    """Fill the contiguous CPU tensor `out` from `fd` at `offset` with pread (the GIL released:
    reads on several threads copy at once); a file that ends first raises OSError(EIO, short)."""
    view, done = memoryview(out.view(-1).view(torch.uint8).numpy()), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, short)
        done += n


def plan_checkpoint(model: torch.nn.Module, ckpt: Checkpoint) -> list[apply.Write]:
    """Validate a whole checkpoint against the live model from its headers alone: structure,
    then every tensor's name, shape and dtype, and full coverage. Nothing is read or written."""
    mismatches = model.config.structural_mismatches(ckpt.config)
    if mismatches:
        raise WeightValidationError(
            "checkpoint structure does not match the served model: " + "; ".join(mismatches)
        )
    return apply.plan(model, ckpt.specs(), require_full=True)


def copy_checkpoint(writes: list[apply.Write], ckpt: Checkpoint) -> int:
    """Stream a validated checkpoint into the live model, reading in place where it can."""
    return apply.copy(writes, ckpt.fetch, ckpt.read_into, workers=apply.read_workers())

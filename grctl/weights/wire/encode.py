"""Sending in the tensor wire format of SGLang's update_weights_from_tensor.

A payload entry is base64 of a ForkingPickler stream. CUDA tensors travel as IPC handles whose
device field is the GPU's UUID (Ray and friends number the same GPU differently per process);
CPU tensors travel through POSIX shared memory (torch's file_system strategy), so no tensor
bytes cross HTTP. The receiving side is grctl.weights.wire.decode.

Lifetimes: a sender keeps its tensors (and its process) alive until the receiver has replied,
then drops them; the receiver drops every decoded tensor once applied. Then a CPU segment's
reference count reaches zero and it leaves /dev/shm. (torch keeps the receiver connected to each
sender's torch_shm_manager, so one idle manager process per sender lives as long as the server.)
"""

from __future__ import annotations

import base64
import functools
import io
import os
import signal
import sys
import threading
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from grctl.weights.wire import decode
from grctl.weights.wire.cuda import CUDA_DEVICE_ARG, cuda_device_uuid
from grctl.weights.wire.records import FlattenedTensorMetadata

_REF_COUNTER_ARGS = slice(11, 13)  # ref_counter_handle, ref_counter_offset in a CUDA record
_manager_lock = threading.Lock()
_manager_started = False


class Shares:
    """What one serialization lends its receiver, for a sender to take back when the receiver
    never rebuilds the payload (or the segment, or block, stays pinned until the sender exits).

    segments: each CPU storage shared by name carries one extra reference that the receiver's
    rebuild consumes (`release_segments` drops it instead). counters: each CUDA share gets a
    reference counter (a slot in a shared-memory file) set to 1, which the receiver decrements
    when it lets the tensor go (client.devices.release_unclaimed reads and releases those)."""

    def __init__(self) -> None:
        self.segments: list[torch.UntypedStorage] = []
        self.counters: list[tuple[bytes, int]] = []

    def release_segments(self) -> None:
        for storage in self.segments:
            storage._shared_decref()
        self.segments = []


def _reduce_tensor(tensor: torch.Tensor, device_uuid: bool = True, shares: Shares | None = None):
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        if shares is not None:
            shares.counters.append(tuple(args[_REF_COUNTER_ARGS]))
        if device_uuid and type(args[CUDA_DEVICE_ARG]) is int:
            # The receiver may number this GPU differently (CUDA_VISIBLE_DEVICES): its UUID.
            uuid = cuda_device_uuid(args[CUDA_DEVICE_ARG])
            args = (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


def start_shm_manager_detached() -> None:
    """Start torch's torch_shm_manager daemon once per process, with stdout and stderr on
    /dev/null and the signals that could interrupt its start blocked.

    torch starts it on the first named shared-memory allocation, and it inherits our stdout and
    stderr. It outlives this process (the server stays connected to it), so whoever reads our
    output through a pipe (`grctl push | tee`, subprocess.run(capture_output=True)) would wait
    for an EOF that never comes. Once started, the daemon serves this process until it exits.

    Signals: while torch waits for the new daemon's name on a pipe, a signal with a handler
    (Ctrl-C's SIGINT, grctl's SIGTERM) interrupts that read, and torch's retry loop then spins
    forever on the stale result at 100% CPU; a terminal's Ctrl-C also reaches the fresh child,
    still in our process group until it calls setsid, and kills it. So those signals are blocked
    in this thread for the start (the child inherits the mask and keeps them blocked: it exits
    when its last client disconnects) and a pending one is delivered the moment it is done.
    """
    global _manager_started
    with _manager_lock:
        if _manager_started:
            return
        blocked = _start_signals()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            saved, null = (os.dup(1), os.dup(2)), os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, 1)
                os.dup2(null, 2)
                torch.empty(1, dtype=torch.uint8).untyped_storage()._share_filename_cpu_()
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in (*saved, null):
                    os.close(fd)
            _manager_started = True
        finally:  # last: a pending Ctrl-C raises here, with everything above restored
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def shm_manager_started() -> bool:
    return _manager_started


def _start_signals() -> set[signal.Signals]:
    """The terminal's signals, and every signal this process handles (a handler interrupts a
    blocking read; default actions that kill us need no care: nothing is left spinning)."""
    found = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler):
            found.add(sig)
    return found


def _reduce_storage_by_name(storage: torch.UntypedStorage, shares: Shares | None = None):
    # torch's file_system branch, whatever the process-wide sharing strategy: the receiver maps
    # the segment by name, where a file descriptor could not travel inside an HTTP body.
    if storage.device.type != "cpu":
        raise RuntimeError("only CPU storages are shared by name; send the tensor instead")
    start_shm_manager_detached()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # keeps the segment alive if we drop it first; the receiver decrefs
    if shares is not None:
        shares.segments.append(storage)
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class _IpcPickler(ForkingPickler):
    """ForkingPickler with grctl's reducers in its own dispatch table; torch stays unpatched."""

    def __init__(self, file: io.BytesIO, device_uuid: bool = True, shares: Shares | None = None):
        super().__init__(file)
        reduce = functools.partial(_reduce_tensor, device_uuid=device_uuid, shares=shares)
        for cls in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = reduce
        self.dispatch_table[torch.UntypedStorage] = functools.partial(
            _reduce_storage_by_name, shares=shares
        )


class MultiprocessingSerializer:
    @staticmethod
    def serialize(
        obj: object,
        output_str: bool = False,
        *,
        device_uuid: bool = True,
        shares: Shares | None = None,
    ) -> bytes | str:
        """A ForkingPickler stream of `obj` (standard base64 text with `output_str`); `shares`
        collects what it lends the receiver, for a sender to take back if it is never read."""
        buf = io.BytesIO()
        _IpcPickler(buf, device_uuid=device_uuid, shares=shares).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode("ascii") if output_str else data

    @staticmethod
    def deserialize(data: str | bytes) -> object:
        return decode.deserialize(data)


def share_for_ipc(tensor: torch.Tensor) -> torch.Tensor:
    """Move a CPU tensor's storage into shared memory now, in place (serializing does it too).

    CUDA tensors need nothing. Keep the tensor alive until the receiver has replied.
    """
    if tensor.device.type == "cpu":
        start_shm_manager_detached()
        tensor.untyped_storage()._share_filename_cpu_()
    return tensor


def encode_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]], keep_alive: list | None = None
) -> str:
    """One flattened_bucket payload entry; `keep_alive` (a list) receives the flat tensor."""
    bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    if keep_alive is not None:
        keep_alive.append(bucket.get_flattened_tensor())
    return MultiprocessingSerializer.serialize(bucket.to_payload(), output_str=True)


def encode_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], keep_alive: list | None = None
) -> str:
    """A direct/null payload entry. CPU storages move into shared memory in place."""
    pairs = [(name, tensor.detach()) for name, tensor in named_tensors]
    if keep_alive is not None:
        keep_alive.extend(tensor for _, tensor in pairs)
    return MultiprocessingSerializer.serialize(pairs, output_str=True)


# ---- buckets -------------------------------------------------------------------------------


class FlattenedTensorBucket:
    """Tensors of any dtypes packed into one uint8 tensor; records carry byte offsets."""

    supports_multi_dtypes = True  # slime sends one bucket for all dtypes when this is set

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            self._flat, self._metadata = _flatten(named_tensors)
        elif flattened_tensor is not None and metadata is not None:
            self._flat, self._metadata = flattened_tensor, list(metadata)
        else:
            raise ValueError("pass named_tensors, or flattened_tensor and metadata")

    def get_flattened_tensor(self) -> torch.Tensor:
        return self._flat

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self._metadata

    def to_payload(self) -> dict:
        return {"flattened_tensor": self._flat, "metadata": self._metadata}

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return decode.decode_bucket(self.to_payload())


def _flatten(named_tensors) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    flats, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        record = FlattenedTensorMetadata(
            name, tensor.shape, tensor.dtype, offset, offset + flat.numel(), flat.numel()
        )
        flats.append(flat)
        metadata.append(record)
        offset += flat.numel()
    if not flats:
        return torch.empty(0, dtype=torch.uint8), []
    if len({flat.device for flat in flats}) > 1:
        raise ValueError("a bucket's tensors must all be on one device")
    return torch.cat(flats), metadata

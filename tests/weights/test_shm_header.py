"""A pushed chunk's shared-memory segments, as the server opens, reads and lets them go.

A real sender process lends CPU tensors by name (grctl's encoder, torch's file_system
segments) and truncates its own segments on command. The server's side is SegmentReads over
decode_payload. What a sender does to its segment can fail a read, never kill the receiver:
torch's own release of a segment truncated to nothing is a SIGBUS (shown here in a receiver
that lets torch release it), grctl's is not. The reference count each release leaves is
compared with what torch's own release leaves on a twin segment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from grctl.weights.shm_reads import SegmentReads
from grctl.weights.wire.decode import decode_payload

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX /dev/shm")

SENDER = textwrap.dedent(
    """
    import os, sys, torch
    from grctl.weights.wire.encode import encode_named_tensors

    def tensors():  # one contiguous tensor, one strided view (a `direct` payload's kind)
        big = torch.arange(3 * 4000, dtype=torch.float32).reshape(3, 4000)
        return [("w", torch.arange(5000, dtype=torch.float32) * 0.5), ("v", big[:, ::2])]

    keep = []
    for _ in range(int(sys.argv[1])):
        print(encode_named_tensors(tensors(), keep_alive=keep), flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "truncate":
            for name in os.listdir("/dev/shm"):
                if name.startswith(f"torch_{os.getpid()}_"):
                    os.truncate("/dev/shm/" + name, int(arg[0]))
            print("truncated", flush=True)
        elif cmd == "exit":
            break
    del keep  # as grctl's client lets its buckets go: the last reference unlinks each segment
    """
)

RECEIVER = textwrap.dedent(
    """
    import gc, sys
    from grctl.weights.shm_reads import SegmentReads
    from grctl.weights.wire.decode import decode_payload

    mode, payload = sys.argv[1], sys.stdin.readline().strip()
    named = decode_payload(payload, "direct")
    segments = SegmentReads(named) if mode == "grctl" else None
    print("decoded", flush=True)
    sys.stdin.readline()  # the sender has truncated its segments
    if segments is not None:
        try:
            segments.fetch("v", dict(named)["v"])
        except OSError as exc:
            print("short read:", exc, flush=True)
        segments.close()
    del named
    gc.collect()
    print("released", flush=True)
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


@contextmanager
def sender(payloads: int = 1):
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(payloads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(payloads)]
        assert all(lines), "the sender printed no payload"
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        proc.wait(30)
    # the sender's release, or its shm manager once it is gone, unlinks every segment
    assert segments_of(proc.pid, wait=True) == []


def segments_of(pid: int, wait: bool = False) -> list[str]:
    import time

    deadline = time.monotonic() + (10 if wait else 0)
    while True:
        found = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_"))
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def send(proc, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def count_of(name: str) -> int:
    """The int32 reference count at the head of /dev/shm/<name>, read with pread."""
    fd = os.open("/dev/shm/" + name, os.O_RDONLY)
    try:
        return int.from_bytes(os.pread(fd, 4, 0), sys.byteorder, signed=True)
    finally:
        os.close(fd)


def segment_names(named) -> list[str]:
    return sorted({os.fsdecode(t.untyped_storage()._grctl_segment)[1:] for _, t in named})


def test_reads_equal_the_mapped_tensors_in_memory_of_their_own():
    with sender() as (proc, (payload,)):
        named = decode_payload(payload, "direct")
        by_name = dict(named)
        segments = SegmentReads(named)
        try:
            assert len(segments) == 2
            w, v = by_name["w"], by_name["v"]
            dst = torch.empty_like(w)
            assert segments.read_into("w", dst) and torch.equal(dst, w)
            assert not segments.read_into("v", torch.empty(v.shape))  # strided: fetched
            got = segments.fetch("v", v)
            assert torch.equal(got, v) and got.stride() == v.stride()
            assert got.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
            assert segments.fetch("absent", w) is w  # not in a segment: the mapped view
        finally:
            segments.close()
        del named, by_name, w, v


def test_the_reference_count_is_left_as_torchs_own_release_leaves_it():
    """Twin segments, one let go by torch as it stands, one by SegmentReads: the same count,
    the sender's own reference only; both leave /dev/shm with the sender (checked by
    `sender`)."""
    with sender(payloads=2) as (proc, (plain, ours)):
        named = decode_payload(plain, "direct")
        torch_names = segment_names(named)
        del named
        named = decode_payload(ours, "direct")
        our_names = segment_names(named)
        lent = [count_of(n) for n in our_names]
        segments = SegmentReads(named)
        segments.close()
        del named, segments
        assert len(torch_names) == len(our_names) == 2
        after = [count_of(n) for n in our_names]
        assert after == [count_of(n) for n in torch_names] == [c - 1 for c in lent]


@pytest.mark.parametrize("mode, survives", [("grctl", True), ("torch", False)])
def test_a_segment_truncated_to_nothing_cannot_kill_the_receiver(mode, survives):
    """The sender truncates its segments to 0 bytes after the receiver decoded them. torch's
    release through its mapping is then a SIGBUS (the control); SegmentReads' read is a short
    read and its release a pread, and the receiver exits cleanly, the dead segment unlinked."""
    with sender() as (proc, (payload,)):
        receiver = subprocess.Popen(
            [sys.executable, "-c", RECEIVER, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        try:
            send(receiver, payload)
            assert receiver.stdout.readline().strip() == "decoded"
            send(proc, "truncate 0")
            assert proc.stdout.readline().strip() == "truncated"
            send(receiver, "go")
            out, _ = receiver.communicate(timeout=60)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        if survives:
            assert receiver.returncode == 0, out
            assert "short read:" in out and "was truncated while read" in out
            assert "released" in out
            assert segments_of(proc.pid) == []  # unlinked by the receiver: nobody else could
        else:
            assert receiver.returncode == -signal.SIGBUS, (receiver.returncode, out)
            assert "released" not in out
            for name in segments_of(proc.pid):  # what the dead receiver could not let go
                os.unlink("/dev/shm/" + name)
        send(proc, "exit")

"""Staging buffers and copies: pre-faulted shared memory kept per process, one pool per push at a
time, and single-threaded copies equal to torch's own."""

from __future__ import annotations

import os

import pytest
import torch

from grctl.client import buffers, staging


def shmem_resident() -> int:
    """This process's resident shared memory (RssShmem), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no RssShmem in /proc/self/status")


def segment_of(flat: torch.Tensor) -> str:
    return os.fsdecode(flat.untyped_storage()._share_filename_cpu_()[1]).lstrip("/")


def test_a_prefaulted_buffer_is_resident_before_any_write():
    nbytes = 32 << 20
    before = shmem_resident()
    flat = buffers.shared_buffer(nbytes, prefault=True)
    assert shmem_resident() - before >= 0.9 * nbytes
    assert int(flat[:: 1 << 16].sum()) == 0  # zeroed pages
    lazy_before = shmem_resident()
    buffers.shared_buffer(nbytes)
    assert shmem_resident() - lazy_before < 0.1 * nbytes  # not faulted in until written


def test_the_pool_is_kept_across_pushes_and_a_concurrent_push_gets_its_own():
    buffers.release()
    cpu = torch.device("cpu")
    with buffers.pool_for(1 << 20, cpu) as first:
        names = {segment_of(b) for b in first._free}
        with buffers.pool_for(1 << 20, cpu) as other:  # while `first` is held: its own
            assert other is not first
            assert not names & {segment_of(b) for b in other._free}
    with buffers.pool_for(1 << 19, cpu) as again:  # smaller: the same buffers
        assert again is first
    with buffers.pool_for(2 << 20, cpu) as bigger:  # larger: new ones, the old ones dropped
        assert bigger is not first and bigger.nbytes == 2 << 20
    del first, again
    assert not names & set(os.listdir("/dev/shm"))
    buffers.release()


def test_a_pool_with_a_buffer_still_out_is_not_kept():
    buffers.release()
    cpu = torch.device("cpu")
    with buffers.pool_for(1 << 16, cpu) as pool:
        pool.take(1 << 10)  # never given back: a call may still be reading it
    with buffers.pool_for(1 << 16, cpu) as again:
        assert again is not pool and len(again._free) == 2
    buffers.release()


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype", "shape"),
    [
        (torch.float32, torch.float32, (300, 301)),
        (torch.float32, torch.bfloat16, (300, 301)),  # more than one serial piece
        (torch.bfloat16, torch.float32, (7,)),
        (torch.int64, torch.int64, (0,)),
        (torch.float16, torch.bfloat16, (2, 3, 5)),
    ],
)
def test_copy_into_equals_torchs_copy(src_dtype, dst_dtype, shape):
    gen = torch.Generator().manual_seed(0)
    src = (torch.randn(shape, generator=gen) * 100).to(src_dtype)
    dst = torch.empty(shape, dtype=dst_dtype)
    staging.copy_into(dst, src)
    assert torch.equal(dst, src.to(dst_dtype))
    if len(shape) == 2:  # a transposed (non-contiguous) source
        t = torch.empty(shape[::-1], dtype=dst_dtype)
        staging.copy_into(t, src.t())
        assert torch.equal(t, src.t().to(dst_dtype))

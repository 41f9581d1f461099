"""Where the client stages a push for a CUDA server, and what it does about CUDA IPC's limits:
the server's GPU found by UUID (its index is its own), expandable segments refused by name, and
shares that a refused call never rebuilt given back."""

from __future__ import annotations

import os
import uuid

import pytest

from grctl.client import devices
from grctl.errors import ValidationError

GPU_A = "GPU-1b2c3d4e-0000-1111-2222-333344445555"
GPU_B = "GPU-99999999-aaaa-bbbb-cccc-ddddeeeeffff"


def test_server_gpu_found_by_uuid_whatever_its_index_there():
    local = [GPU_B.removeprefix("GPU-"), GPU_A.removeprefix("GPU-")]  # torch omits "GPU-"
    assert devices.local_index(GPU_A, local) == 1  # the server calls it cuda:0
    assert devices.local_index(GPU_B.upper(), local) == 0
    assert devices.local_index("GPU-00000000-0000-0000-0000-000000000000", local) is None


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_refused_by_name(monkeypatch, var):
    monkeypatch.setenv(var, "max_split_size_mb:128, expandable_segments:True")
    with pytest.raises(ValidationError, match=f"{var}=.*expandable_segments") as err:
        devices.stage_device("cuda:0", gpu_uuid=GPU_A)
    assert "--transport disk" in err.value.hint
    monkeypatch.setenv(var, "expandable_segments:False")
    with pytest.raises(ValidationError, match="no CUDA device"):  # this machine has none
        devices.stage_device("cuda:0", gpu_uuid=GPU_A)
    assert devices.stage_device("cpu").type == "cpu"


@pytest.fixture()
def counter_file():
    """A reference-counter file as torch lays it out: int64 slots in POSIX shared memory."""
    name = f"/grctl_test_{uuid.uuid4().hex}"
    fd = os.open(f"/dev/shm{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 8 * 16)
    yield name.encode(), fd
    os.close(fd)
    os.unlink(f"/dev/shm{name}")


def test_shares_a_server_never_rebuilt_are_released(counter_file):
    handle, fd = counter_file

    def count(slot: int) -> int:
        return int.from_bytes(os.pread(fd, 8, 8 * slot), "little", signed=True)

    def release(h: bytes, slot: int) -> None:  # what the receiver's rebuild-and-drop does
        assert h == handle
        os.pwrite(fd, (count(slot) - 1).to_bytes(8, "little", signed=True), 8 * slot)

    os.pwrite(fd, (1).to_bytes(8, "little"), 8 * 2)  # slot 2: refused before decoding
    # slot 5: rebuilt and dropped by the server (already 0)
    assert devices.release_unclaimed([(handle, 2), (handle, 5)], release) == 1
    assert count(2) == 0 and count(5) == 0
    assert devices.release_unclaimed([(handle, 2)], release) == 0  # never below zero
    assert devices.release_unclaimed([(b"/grctl_test_gone", 0)], release) == 0

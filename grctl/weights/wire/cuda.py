"""What the wire asks of CUDA: a GPU's UUID and the device allocation holding an address.

Senders name a GPU by UUID, since processes number the same GPU differently
(CUDA_VISIBLE_DEVICES); the receiver bounds an opened IPC block by its allocation's extent.
Both import on a machine without CUDA (libcuda is looked up only when asked).
"""

from __future__ import annotations

import ctypes
import functools

import torch

# Index of the device in torch's rebuild_cuda_tensor arguments (tensor_cls, size, stride,
# storage_offset, storage_cls, dtype, storage_device, storage_handle, ...): 15 in all.
CUDA_DEVICE_ARG = 6


def cuda_device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


@functools.cache
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_address_range(ptr: int, device: int) -> tuple[int, int] | None:
    """(base, size) of the allocation holding `ptr` (cuMemGetAddressRange, asked in `device`'s
    context, where torch opens IPC handles), or None when the driver cannot say."""
    lib = _libcuda()
    fn = getattr(lib, "cuMemGetAddressRange_v2", None) if lib is not None else None
    if fn is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(device):
        if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
            return None
    return base.value, size.value

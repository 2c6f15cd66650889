"""Moving arrays that the CPU wrote to the GPU before their first use.

On CUDA every MLX array lives in unified memory (``cudaMallocManaged``). A
restore from disk writes its arrays from the CPU, so their pages sit in host
memory and the GPU's first reads migrate them a page fault at a time. One
``cuMemPrefetchAsync`` per array moves them in bulk instead. Elsewhere (the
CPU, Metal, no CUDA driver) ``prefetch_to_gpu`` does nothing.

The CUDA driver API is called through ctypes: MLX links the runtime
statically, and both use the device's primary context, so a pointer MLX
allocated is valid here.
"""

import ctypes
import functools

import mlx.core as mx
import numpy as np

CU_MEM_LOCATION_TYPE_DEVICE = 1
ENABLED = True  # benchmarks turn it off to compare


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Driver:
    """The few driver calls a prefetch needs, on device 0."""

    def __init__(self, lib):
        self.lib = lib
        for name in ("cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2"):
            getattr(lib, name).restype = ctypes.c_int
        self.prefetch_v2 = getattr(lib, "cuMemPrefetchAsync_v2", None)
        if self.prefetch_v2 is not None:
            self.prefetch_v2.argtypes = [
                ctypes.c_uint64,
                ctypes.c_size_t,
                MemLocation,
                ctypes.c_uint,
                ctypes.c_void_p,
            ]
        else:
            lib.cuMemPrefetchAsync.argtypes = [
                ctypes.c_uint64,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
        self.context = ctypes.c_void_p()
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), 0))

    @staticmethod
    def check(status: int):
        if status != 0:
            raise OSError(f"CUDA driver call failed (CUresult {status})")

    def prefetch(self, regions: list[tuple[int, int]]):
        """Move each (address, bytes) region to device 0 and wait."""
        lib = self.lib
        location = MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0)
        self.check(lib.cuCtxPushCurrent_v2(self.context))
        try:
            for address, size in regions:
                if self.prefetch_v2 is not None:
                    status = self.prefetch_v2(address, size, location, 0, None)
                else:
                    status = lib.cuMemPrefetchAsync(address, size, 0, None)
                self.check(status)
            self.check(lib.cuCtxSynchronize())
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def driver() -> Driver | None:
    """The CUDA driver if MLX runs on a CUDA GPU, else None."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None
    return _driver()


@functools.cache
def _driver() -> Driver | None:
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """Whether arrays can be moved (CUDA, and not turned off)."""
    return ENABLED and driver() is not None


def prefetch_to_gpu(arrays) -> bool:
    """Move evaluated ``arrays`` to the GPU now (CUDA), so that their first
    use does not fault their pages in one by one; whether it did."""
    if not available():
        return False
    regions = []
    for x in arrays:
        view = np.asarray(x)  # a view of the array's memory, no copy
        if view.nbytes:
            regions.append((view.ctypes.data, view.nbytes))
    try:
        driver().prefetch(regions)
    except OSError:
        return False
    return True

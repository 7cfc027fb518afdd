"""A stand-in for PyTorch (see ../README.md): torch.empty/ones, torch.OutOfMemoryError and the
torch.cuda calls scripts/gpu_check_probe.py makes, on the CUDA driver through ctypes."""

import ctypes

uint8 = "uint8"
float32 = "float32"
_cuda = ctypes.CDLL("libcuda.so.1")
_ctx = []
_CUDA_ERROR_OUT_OF_MEMORY = 2


class OutOfMemoryError(RuntimeError):
    pass


def _check(result, call):
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result}")


def _init():
    if not _ctx:
        ctx = ctypes.c_void_p()
        _check(_cuda.cuInit(0), "cuInit")
        _check(_cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
        _ctx.append(ctx)
    _check(_cuda.cuCtxSetCurrent(_ctx[0]), "cuCtxSetCurrent")


class _Tensor:
    def __init__(self, nbytes, elements):
        _init()
        self._ptr = ctypes.c_uint64()
        result = _cuda.cuMemAlloc_v2(ctypes.byref(self._ptr), ctypes.c_size_t(nbytes))
        if result == _CUDA_ERROR_OUT_OF_MEMORY:
            self._ptr = None
            raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
        _check(result, "cuMemAlloc_v2")
        self._nbytes = nbytes
        self._elements = elements
        cuda.reserved += nbytes

    def __del__(self):
        if self._ptr is not None:
            _cuda.cuMemFree_v2(self._ptr)
            cuda.reserved -= self._nbytes

    def sum(self):
        return self

    def item(self):
        return self._elements


def empty(n, dtype=uint8, device="cuda"):
    assert dtype == uint8 and device == "cuda"
    return _Tensor(n, n)


def ones(n, device="cuda"):
    assert device == "cuda"
    return _Tensor(4 * n, n)


class _Props:  # pylint: disable=too-few-public-methods
    def __init__(self, total):
        self.total_memory = total


class cuda:  # pylint: disable=invalid-name
    OutOfMemoryError = OutOfMemoryError
    reserved = 0

    @staticmethod
    def is_available():
        count = ctypes.c_int()
        return _cuda.cuInit(0) == 0 and _cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0

    @staticmethod
    def mem_get_info():
        _init()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _check(_cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
        return free.value, total.value

    @staticmethod
    def get_device_properties(ordinal):
        _init()
        total = ctypes.c_size_t()
        _check(_cuda.cuDeviceTotalMem_v2(ctypes.byref(total), ordinal), "cuDeviceTotalMem_v2")
        return _Props(total.value)

    @staticmethod
    def memory_reserved():
        return cuda.reserved

    @staticmethod
    def empty_cache():
        pass

"""A stand-in for TensorFlow (see ../README.md): just enough of its API for
examples/tf_stress/tf_stress.py. Like TensorFlow it uses the primary context of device 0; a tensor
is one cuMemAlloc_v2 whose out-of-memory failure becomes ResourceExhaustedError, except that small
tensors (up to 1 MiB) share one 2 MiB region taken at the first of them and kept, as TensorFlow's
BFC allocator does with memory growth on (TensorFlow 2.20: "Next region of size 2097152" in its
allocator dump). Unlike that allocator (whose own limit comes from cuMemGetInfo) every other
request goes to the driver, where cuvisor's quota decides."""

import contextlib
import ctypes

float32 = "float32"
_cuda = ctypes.CDLL("libcuda.so.1")


def _check(result, call):
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result}")


class errors:  # pylint: disable=invalid-name,too-few-public-methods
    class ResourceExhaustedError(Exception):
        def __init__(self, message):
            super().__init__(message)
            self.message = message


class config:  # pylint: disable=invalid-name,too-few-public-methods
    class experimental:  # pylint: disable=too-few-public-methods
        @staticmethod
        def set_memory_growth(_device, _enable):
            pass

    @staticmethod
    def list_physical_devices(kind):
        count = ctypes.c_int()
        _check(_cuda.cuInit(0), "cuInit")
        _check(_cuda.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        return [f"/physical_device:{kind}:{i}" for i in range(count.value)]

    @staticmethod
    def list_logical_devices(kind):
        # TensorFlow retains device 0's primary context for good when it creates the device.
        ctx = ctypes.c_void_p()
        _check(_cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
        _check(_cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        return [f"/device:{kind}:0"]


def device(_name):
    return contextlib.nullcontext()


class _Tensor:  # pylint: disable=too-few-public-methods
    device = "/job:localhost/replica:0/task:0/device:GPU:0"

    def __init__(self, ptr):
        self._ptr = ptr

    def numpy(self):
        return None  # the simulator computes nothing

    def __del__(self):
        if self._ptr is not None:
            _cuda.cuMemFree_v2(self._ptr)


_MIB = 1 << 20
_region = []  # the small tensors' region, once taken


def _alloc(nbytes, shape):
    ptr = ctypes.c_uint64()
    result = _cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    if result == 2:
        raise errors.ResourceExhaustedError(
            f"OOM when allocating tensor with shape[{shape[0]}] and type float "
            "on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc"
        )
    _check(result, "cuMemAlloc_v2")
    return ptr


def zeros(shape, dtype):
    assert dtype == float32
    nbytes = shape[0] * 4
    if nbytes > _MIB:
        return _Tensor(_alloc(nbytes, shape))
    if not _region:
        _region.append(_alloc(2 * _MIB, shape))
    return _Tensor(None)

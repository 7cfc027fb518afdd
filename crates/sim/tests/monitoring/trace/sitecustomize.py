"""Loaded by every Python process the monitoring probe starts (PYTHONPATH): counts what each NVML
call pynvml makes answered, by wrapping the CDLL pynvml loads, and appends `name code count`
lines to the file NVML_TRACE names when the process exits. Nothing else changes: the tools call
the simulated libnvidia-ml.so.1 exactly as they would a real one."""
import atexit
import os

_LOG = os.environ.get("NVML_TRACE")
_calls = {}

if _LOG:
    import pynvml

    class _Traced:
        """A function of the library: calls it, counts (name, return code)."""

        def __init__(self, name, fn):
            object.__setattr__(self, "_name", name)
            object.__setattr__(self, "_fn", fn)

        def __call__(self, *args):
            r = self._fn(*args)
            if isinstance(r, int):
                key = (self._name, r)
                _calls[key] = _calls.get(key, 0) + 1
            return r

        def __setattr__(self, k, v):  # restype / argtypes go to the real function
            setattr(self._fn, k, v)

        def __getattr__(self, k):
            return getattr(self._fn, k)

    class _Library:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return _Traced(name, getattr(self._lib, name))

    _load = pynvml._LoadNvmlLibrary

    def _load_traced():
        _load()
        if pynvml.nvmlLib is not None and not isinstance(pynvml.nvmlLib, _Library):
            pynvml.nvmlLib = _Library(pynvml.nvmlLib)

    pynvml._LoadNvmlLibrary = _load_traced

    @atexit.register
    def _dump():
        with open(_LOG, "a") as f:
            for (name, code), n in _calls.items():
                f.write(f"{name} {code} {n}\n")

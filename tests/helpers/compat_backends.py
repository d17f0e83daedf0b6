"""The backend an engine shim's check runs on, shared by the shims' tests."""
import contextlib

from specdec_ext import compat


def on(backend):
    """An engine shim's backend for a block: specdec_ext's own kernels (chosen by the tensors' device), or ("sim")
    the CUDA kernels' source under the emulator."""
    return compat.emulated() if backend == "sim" else contextlib.nullcontext()

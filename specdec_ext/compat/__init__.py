"""Drop-in shims with the engines' own signatures (docs/design.md §5): `compat.flashinfer`, `compat.vllm`,
`compat.sglang`, `compat.transformers`. Each module imports no engine when it is imported, follows the contract of the
engine version its docstring names, and refuses the engine's lossy modes: this library is lossless.

The shims call the public ops of specdec_ext (CPU and CUDA kernels, chosen by the tensors' device). `emulated()`
runs them on the CUDA kernels' source under the SIMT emulator instead (CPU tensors; for tests).
"""
import contextlib
import inspect
import sys
import threading

from .. import ops

_selected = threading.local()


def backend() -> ops.Ops:
    """The ops the shims call on this thread: specdec_ext's own, or the emulator's inside `emulated()`."""
    return getattr(_selected, "ops", None) or ops.NATIVE


@contextlib.contextmanager
def emulated():
    """Within the block, on this thread, the shims run the CUDA kernels' source under the emulator (specdec_ext.sim)."""
    from .. import sim

    previous = getattr(_selected, "ops", None)
    _selected.ops = sim.EMULATED
    try:
        yield
    finally:
        _selected.ops = previous


def parameters(fn) -> list[str]:
    """The names of fn's parameters, self left out ([] when it has no signature)."""
    try:
        return [p for p in inspect.signature(fn).parameters if p != "self"]
    except (TypeError, ValueError):
        return []


def replace_in_vllm_modules(name: str, old, new) -> list[str]:
    """Sets attribute `name` to `new` in every loaded vllm module whose `name` is `old` (the modules that imported
    vLLM's object); returns the attribute paths changed, sorted."""
    patched = []
    for module_name, module in list(sys.modules.items()):
        if (module_name == "vllm" or module_name.startswith("vllm.")) and module is not None and \
                getattr(module, name, None) is old:
            setattr(module, name, new)
            patched.append(f"{module_name}.{name}")
    return sorted(patched)

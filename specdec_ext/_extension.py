"""Loading the compiled extensions, with a message that says how to build them when they are missing."""
import importlib

import torch  # noqa: F401  (the extensions link against libtorch: torch must be loaded first)

_BUILD_HINT = (
    "build it from the source checkout with `bash scripts/test.sh` (venv, build and tests) or "
    "`pip install --no-build-isolation -e .` inside an environment that has torch"
)


def load(name: str):
    """Imports specdec_ext.<name> (`_C`: CPU/CUDA kernels, `_sim`: emulated CUDA kernels)."""
    try:
        return importlib.import_module(f"specdec_ext.{name}")
    except ImportError as e:
        what = "emulator extension" if name == "_sim" else "compiled extension"
        raise ImportError(f"specdec_ext's {what} specdec_ext.{name} could not be imported ({e}); {_BUILD_HINT}") from e

"""Loading the compiled extensions, with a message that says how to build them when they are missing."""
import importlib

import torch  # noqa: F401  (the extensions link against libtorch: torch must be loaded first)

_BUILD_HINT = (
    "build it from the source checkout with `bash scripts/test.sh` (venv, build and tests) or "
    "`pip install --no-build-isolation -e .` inside an environment that has torch"
)


def load(name: str):
    """Imports specdec_ext.<name> (`_C`: CPU/CUDA kernels, `_sim`: emulated CUDA kernels). An emulator built with
    AddressSanitizer in a process that did not start with the ASan runtime raises EmulatorNeedsASanRuntime (an
    ImportError) instead of letting the runtime abort the process."""
    if name == "_sim":
        preload = sim_asan_preload()
        if preload is not None:
            raise EmulatorNeedsASanRuntime(preload)
    try:
        return importlib.import_module(f"specdec_ext.{name}")
    except ImportError as e:
        what = "emulator extension" if name == "_sim" else "compiled extension"
        raise ImportError(f"specdec_ext's {what} specdec_ext.{name} could not be imported ({e}); {_BUILD_HINT}") from e


# --- The emulator built with AddressSanitizer (scripts/test.sh: SPECDEC_SIM_ASAN=1) ---------------------------------
# Such a specdec_ext._sim links libasan, and the ASan runtime aborts the whole process (exit 1, no Python error) when
# it is loaded by dlopen into a process that did not start with it: it must come first, by LD_PRELOAD. The functions
# below tell, without importing the extension, whether importing it here is safe, and how to run it where it is not.

class EmulatorNeedsASanRuntime(ImportError):
    """specdec_ext.sim cannot be imported in this process: the emulator is built with AddressSanitizer and the ASan
    runtime was not preloaded. .preload: the LD_PRELOAD value that runs it."""

    def __init__(self, preload: str):
        self.preload = preload
        super().__init__(f"the emulator extension is built with AddressSanitizer (SPECDEC_SIM_ASAN=1, as "
                         f"scripts/test.sh builds it) and this process did not start with the ASan runtime; run with "
                         f"{sim_asan_hint(preload, 'COMMAND')}, or rebuild it without: SPECDEC_SIM_ASAN=0 bash "
                         f"scripts/setup_env.sh")


def _dt_needed(path) -> list[str]:
    """The DT_NEEDED entries (sonames) of an ELF64 little-endian shared object; [] when it cannot be read as one."""
    import struct

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    try:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            return []
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        needed = []
        for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
            if sh_type != 6 or not entsize:  # SHT_DYNAMIC
                continue
            strtab_offset = sections[link][4]
            for i in range(size // entsize):
                tag, value = struct.unpack_from("<qQ", data, offset + i * entsize)
                if tag == 0:  # DT_NULL
                    break
                if tag == 1:  # DT_NEEDED
                    end = data.index(b"\0", strtab_offset + value)
                    needed.append(data[strtab_offset + value:end].decode(errors="replace"))
    except (struct.error, IndexError, ValueError):  # not a well-formed ELF64 file
        return []
    return needed


def sim_library():
    """The emulator extension's file (specdec_ext/_sim*.so), or None when it is not built. Does not import it."""
    import importlib.util

    spec = importlib.util.find_spec("specdec_ext._sim")
    return None if spec is None or not spec.origin else spec.origin


def _asan_runtime_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return any("libasan" in line for line in f)
    except OSError:
        return False


def _resolve(soname: str) -> str:
    """A library's path as gcc finds it (as scripts/test.sh does), else the soname (the dynamic loader searches)."""
    import os
    import subprocess

    try:
        found = subprocess.run(["gcc", f"-print-file-name={soname}"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return soname
    return os.path.normpath(found) if os.path.isabs(found) and os.path.exists(found) else soname


def sim_asan_preload() -> str | None:
    """When the emulator extension is built with AddressSanitizer and this process did not start with the ASan runtime
    (so that importing specdec_ext.sim here would abort the process): the LD_PRELOAD value it needs (the ASan runtime,
    then libstdc++ so that ASan's C++-exception interceptor resolves at start-up), else None."""
    path = sim_library()
    if path is None:
        return None
    needed = _dt_needed(path)
    asan = next((n for n in needed if n.startswith("libasan.")), None)
    if asan is None or _asan_runtime_loaded():
        return None
    stdcxx = next((n for n in needed if n.startswith("libstdc++.")), "libstdc++.so.6")
    return f"{_resolve(asan)} {_resolve(stdcxx)}"


def sim_asan_env(preload: str) -> dict:
    """os.environ for a child process that imports the ASan-built emulator: the runtime preloaded, leak checks off
    (CPython and torch keep allocations alive at exit), as scripts/test.sh runs the tests."""
    import os

    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(x for x in (preload, env.get("LD_PRELOAD", "")) if x)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    return env


def sim_asan_hint(preload: str, command: str = "specdec info") -> str:
    return f'LD_PRELOAD="{preload}" ASAN_OPTIONS=detect_leaks=0 {command}'


def run_sim_in_subprocess(code: str, timeout: float = 300):
    """Runs python code that imports specdec_ext.sim in a child process with the ASan runtime preloaded (when the
    emulator needs it); returns (returncode, stdout, stderr)."""
    import subprocess
    import sys

    preload = sim_asan_preload()
    env = sim_asan_env(preload) if preload else None
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    return r.returncode, r.stdout, r.stderr

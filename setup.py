"""Builds specdec_ext: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc is found, and
the SIMT emulator's twin of the CUDA kernels (specdec_ext._sim).

Environment:
  TORCH_CUDA_ARCH_LIST   CUDA architectures (default: cuda_archs of build_settings.json, the release wheel
                         set); developers iterate with one (scripts/setup_env.sh: dev_cuda_archs)
  SPECDEC_CPU_ONLY=1     build without CUDA even where it is available
  SPECDEC_SIM_ASAN=1     build the emulator extension with AddressSanitizer (run it with libasan preloaded)
  SPECDEC_NO_SIM=1       skip the emulator extension (release wheels)
  SPECDEC_NO_EXTENSIONS=1  compile nothing: scripts/setup_env.sh registers an editable install this way
                         once, then compiles in place with `setup.py build_ext --inplace` (incremental)
  CUDA_HOME              the CUDA toolkit (default /usr/local/cuda when it exists)
"""
import json
import os
import re
import shutil
import site
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
# Shared with CMakeLists.txt and the scripts. -ffp-contract=off (host_cxx_flags) is what the bit-exactness of
# the CPU kernels, the CUDA kernels and the emulator rests on (sampling_math.h).
SETTINGS = json.loads((ROOT / "build_settings.json").read_text())
DEFAULT_CUDA_ARCHS = SETTINGS["cuda_archs"]
HOST_CXX_FLAGS = SETTINGS["host_cxx_flags"]

# torch.utils.cpp_extension reads CUDA_HOME when imported; a wrapper nvcc on PATH must not win.
if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "specdec_ext" / "_version.py").read_text()).group(1)


def flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def with_cuda() -> bool:
    if flag("SPECDEC_CPU_ONLY"):
        return False
    if torch.version.cuda is None:
        print("specdec setup: torch has no CUDA; building the CPU kernels only", file=sys.stderr)
        return False
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        print("specdec setup: nvcc not found (set CUDA_HOME); building the CPU kernels only", file=sys.stderr)
        return False
    return True


def nvidia_wheel_includes() -> list[str]:
    """Headers of the nvidia-* wheels torch depends on (cusparse.h etc. are not in every toolkit)."""
    dirs = []
    for sp in site.getsitepackages() + [site.getusersitepackages()]:
        for inc in sorted(Path(sp).glob("nvidia/*/include")):
            dirs.append(str(inc))
    return dirs


def rel(paths):
    return sorted(str(p.relative_to(ROOT)) for p in paths)


INCLUDES = [str(ROOT / "csrc"), str(ROOT / "csrc" / "include")]
CXX_FLAGS = ["-O3", *HOST_CXX_FLAGS, "-Wall", "-Wno-unused-function", f'-DSPECDEC_VERSION="{VERSION}"']

# at::parallel_for runs its OpenMP loop only when the caller is compiled with OpenMP (the pragma is in ATen's
# header); the runtime is torch's own libgomp, already loaded when the extension is.
OPENMP = ["-fopenmp"]


def extensions() -> list:
    if flag("SPECDEC_NO_EXTENSIONS"):
        return []
    result = []
    sources = ["csrc/ops.cpp", "csrc/bindings.cpp"] + rel((ROOT / "csrc" / "cpu").glob("*.cpp"))
    if with_cuda():
        archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        defines = ["-DSPECDEC_WITH_CUDA", f'-DSPECDEC_CUDA_ARCHS="{archs}"']
        nvcc_flags = ["-O3", "-std=c++20", "-lineinfo", "--expt-relaxed-constexpr", f'-DSPECDEC_VERSION="{VERSION}"']
        result.append(
            CUDAExtension(
                "specdec_ext._C",
                sources + rel((ROOT / "csrc" / "cuda").glob("*.cu")),
                include_dirs=INCLUDES + nvidia_wheel_includes(),
                extra_compile_args={"cxx": CXX_FLAGS + OPENMP + defines, "nvcc": nvcc_flags + defines},
                extra_link_args=OPENMP,
            )
        )
    else:
        result.append(CppExtension("specdec_ext._C", sources, include_dirs=INCLUDES,
                                   extra_compile_args={"cxx": CXX_FLAGS + OPENMP}, extra_link_args=OPENMP))

    if not flag("SPECDEC_NO_SIM"):
        sim_flags = [*HOST_CXX_FLAGS, "-O1", "-g", "-Wno-unknown-pragmas", "-DSPECDEC_SIM",
                     f'-DSPECDEC_VERSION="{VERSION}"']
        sim_link = []
        if flag("SPECDEC_SIM_ASAN"):
            sim_flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
            sim_link += ["-fsanitize=address"]
        result.append(
            CppExtension(
                "specdec_ext._sim",
                ["csrc/sim/sim.cpp", "csrc/sim/sim_ops.cpp"],
                include_dirs=INCLUDES,
                extra_compile_args={"cxx": sim_flags},
                extra_link_args=sim_link,
            )
        )
    return result


setup(
    name="specdec_ext",
    version=VERSION,
    description="CUDA kernels for lossless speculative decoding: verify attention, rejection sampling, KV-cache "
                "truncation",
    packages=find_packages(include=["specdec_ext", "specdec_ext.*"]),
    # The prompt sets and seeds, the trained heads.
    package_data={"specdec_ext": ["data/*.json", "data/*.jsonl", "data/*.safetensors"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    entry_points={"console_scripts": ["specdec = specdec_ext.cli:main"],
                  "vllm.general_plugins": ["specdec_ext = specdec_ext.compat.vllm:register"]},
    zip_safe=False,
)

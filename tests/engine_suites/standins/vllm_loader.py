"""vLLM's Python package from a release's source tree, importable on a machine without vLLM's compiled parts.

    finder = install(Path(".../vllm-0.34.0"))   # before anything imports vllm
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler   # vLLM's own module, executed from the source tree

`install` puts a meta-path finder first that serves `vllm` and its submodules from `<root>/vllm`: each module is
vLLM's own source, executed. A module whose execution raises (it imports a compiled extension, CUDA, a package not
installed here) keeps what it defined before the failure and answers every other name with `StandIn`, an object that
absorbs attribute access, calls, subscripts and `|` (so annotations and decorators built from it evaluate).
`finder.stood_in` lists them with the reason, for the run's notes. A module missing from the tree is not found
(ModuleNotFoundError), as in an installed vLLM: a release without Model Runner V1 has no
vllm.v1.sample.rejection_sampler.
Tests only exercise the modules that execute in full: the rejection sampler's, its Triton kernels, its sampler.

`vllm.triton_utils` is replaced by the real `triton` (its own module falls back to placeholders when it finds no GPU),
and TRITON_INTERPRET=1 makes every `@triton.jit` kernel vLLM defines run in Triton's CPU interpreter. The current
platform is vLLM's own CpuPlatform (`_use_cpu_platform`).
"""
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

PACKAGE = "vllm"


class _StandInType(type):
    """StandIn's class-level behaviour: StandIn itself is used as a base class, an annotation and a type union."""

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __getitem__(cls, item):
        return cls

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn


class StandIn(metaclass=_StandInType):
    """What a name of a module that could not execute resolves to: callable, subscriptable, any attribute."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return StandIn()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn()


class StandInModule(types.ModuleType):
    """A module of vLLM's that could not execute here: the names it defined stay, the others are StandIn."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn


def _triton_utils():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    module = types.ModuleType(f"{PACKAGE}.triton_utils")
    module.triton, module.tl, module.tldevice, module.HAS_TRITON = triton, tl, libdevice, True
    return module


OVERRIDES = {f"{PACKAGE}.triton_utils": _triton_utils}


class _Made(importlib.abc.Loader):
    def __init__(self, make):
        self.make = make

    def create_module(self, spec):
        return self.make()

    def exec_module(self, module):
        pass


class _SourceLoader(importlib.abc.Loader):
    def __init__(self, finder, file):
        self.finder, self.file = finder, file

    def create_module(self, spec):
        return StandInModule(spec.name) if self.file is None else None

    def exec_module(self, module):
        if self.file is None:  # a folder without __init__.py: a namespace package
            return
        module.__file__ = str(self.file)
        code = compile(self.file.read_text(), str(self.file), "exec")
        try:
            exec(code, module.__dict__)
        except Exception as error:  # its own imports need what is not here: a stand-in from the failure on
            self.finder.stood_in.append(f"{module.__name__} ({type(error).__name__}: {str(error)[:120]})")
            module.__class__ = StandInModule


class VllmSourceFinder(importlib.abc.MetaPathFinder):
    """Serves `vllm.*` from root/vllm (module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.stood_in = []

    def find_spec(self, name, path, target=None):
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            return None
        if name in OVERRIDES:
            return importlib.machinery.ModuleSpec(name, _Made(OVERRIDES[name]))
        base = self.root.joinpath(*name.split("."))
        if base.is_dir():
            init = base / "__init__.py"
            spec = importlib.machinery.ModuleSpec(name, _SourceLoader(self, init if init.exists() else None),
                                                  origin=str(init), is_package=True)
            spec.submodule_search_locations = [str(base)]
            return spec
        file = base.with_suffix(".py")
        if file.exists():
            return importlib.machinery.ModuleSpec(name, _SourceLoader(self, file), origin=str(file))
        return None  # not in the release: the other finders do not have it either


def _use_cpu_platform() -> None:
    """vLLM detects no platform without its compiled parts: its own CPU platform is the one the tests run on. Its
    CPU platform reports UVA, whose buffers pin host memory (a CUDA driver's job): vLLM's explicit-copy fallback is
    what runs without one."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    try:
        from vllm.utils import platform_utils
    except ImportError:  # a release without it has no UVA buffers either
        return
    if hasattr(platform_utils, "is_uva_available"):
        platform_utils.is_uva_available = lambda: False


def install(root: Path) -> VllmSourceFinder:
    """Serves vllm from the source tree at root (its top folder, holding vllm/), Triton kernels interpreted, on
    vLLM's CPU platform."""
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated: set before vLLM's modules execute
    if any(m == PACKAGE or m.startswith(PACKAGE + ".") for m in sys.modules):
        raise RuntimeError("vllm is imported already: install the source finder before anything imports it")
    finder = VllmSourceFinder(root)
    sys.meta_path.insert(0, finder)
    _use_cpu_platform()
    return finder

"""transformers: assisted decoding's `transformers.generation.utils._speculative_sampling`, which
specdec_ext.compat.transformers.patch() rebinds.

transformers' sdists ship only the common test mixins (tests/test_*_common.py), not tests/generation/: its own tests of
assisted decoding are not on PyPI. What runs per release instead: the release's own pure-Python package (its sdist's
src/transformers, first on sys.path) under specdec_ext's transformers shim tests (tests/test_compat_transformers.py:
generate() with an assistant under patch(), and laws), and the release's source against the shim's signature (the
function's parameters, and the call that `_assisted_decoding` makes of it)."""
import importlib.util
from pathlib import Path

from . import TESTS_DIR, Source, Suite, contract, note, write_conftest

PROJECT = "transformers"
SHIM = "specdec_ext.compat.transformers:speculative_sampling"
_FIFTH = ("the shim's fifth positional is is_done_candidate (transformers <= 5.17, a bool flag); anything else there "
          "is read as assistant_ensemble_weight, which transformers >= 5.18 passes by keyword")

_CONFTEST = '''
import importlib.util

_spec = importlib.util.spec_from_file_location("specdec_tests_conftest", {conftest!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
globals().update({{k: v for k, v in vars(_module).items() if not k.startswith("__")}})


def pytest_report_header(config):
    import transformers

    return [_module.pytest_report_header(config),
            f"transformers {{transformers.__version__}} from {{transformers.__file__}}"]
'''
_TEST = '''"""specdec_ext's transformers shim tests, with this release's transformers (tests/engine_suites)."""
import transformers

from test_compat_transformers import *  # noqa: F401,F403


def test_release_is_the_one_loaded():
    assert transformers.__version__ == {version!r}, transformers.__file__
'''


def sources(version: str) -> dict:
    return {"release": Source(PROJECT, version, ("src/transformers/*",))}


def adapt(trees: dict, version: str, out_dir: Path) -> list:
    src = trees["release"] / "src"
    (out_dir / "test_compat_transformers_release.py").write_text(_TEST.format(version=version))
    utils = src / "transformers" / "generation" / "utils.py"
    allow = {"assistant_ensemble_weight": _FIFTH} if _takes_flag(utils) else {}
    checks = [
        {"kind": "signature", "id": "_speculative_sampling", "file": str(utils), "qualname": "_speculative_sampling",
         "shim": SHIM, "allow": allow or {"assistant_ensemble_weight": _FIFTH}},
        {"kind": "call", "id": "_assisted_decoding", "file": str(utils), "caller": "GenerationMixin._assisted_decoding",
         "callee": "_speculative_sampling", "shim": SHIM},
    ]
    args = contract.write_checks(out_dir, checks)
    missing = [m for m in _imports(src) if importlib.util.find_spec(m) is None]
    if missing:  # the package cannot be imported here: its signatures are still checked
        note(out_dir, f"transformers {version} imports {', '.join(missing)}, not installed with this environment's "
                      "huggingface_hub: only its signatures were checked")
        write_conftest(out_dir)
        return args
    write_conftest(out_dir, [src, TESTS_DIR], _CONFTEST.format(conftest=str(TESTS_DIR / "conftest.py")))
    return ["test_compat_transformers_release.py"] + args


def _imports(src: Path) -> list:
    """Third-party modules the release's transformers.utils.hub imports directly (5.17: httpx)."""
    text = (src / "transformers" / "utils" / "hub.py").read_text()
    return [m for m in ("httpx",) if f"\nimport {m}\n" in text]


def _takes_flag(utils: Path) -> bool:
    return "    is_done_candidate,\n    assistant_ensemble_weight" in utils.read_text()


SUITE = Suite(
    name="transformers",
    project=PROJECT,
    versions=("5.17.0", "5.18.0", "5.25.0"),
    sources=sources,
    adapt=adapt,
    deselected={},
    budget={
        "test_compat_transformers_release.py::*emulated*":
            "the CUDA kernels' emulator: tests/test_compat_transformers.py runs it against the installed transformers",
    },
    minimum_passed=15,
    tests_from="specdec_ext's transformers shim tests with the release's own package (transformers ships no tests "
               "of assisted decoding on PyPI), and the release's signatures",
)

"""SGLang: the EAGLE verify step's tree_speculative_sampling_target_only and verify_tree_greedy against
specdec_ext.compat.sglang.

SGLang's tests of these kernels live in its repository (sgl-kernel/tests/) and are in no PyPI artifact: sgl-kernel
publishes wheels only (no tests in them), and sglang's sdists (to 0.5.10.post1) and wheels (0.5.11 on) hold none of
them. What runs per release instead is the contract, from the release's own source: every call that SGLang's
speculative-decoding code (sglang/srt/speculative/) makes of the two functions binds to the shim's signature, and,
from the releases that define the kernels' Python entry points themselves (sglang.kernels.ops.speculative, 0.5.2x on
CUDA), their signatures are the shim's. Behaviour is tested by tests/test_compat_sglang.py.
"""
import ast
from pathlib import Path

from . import Source, Suite, contract, write_conftest

PROJECT = "sglang"
SHIM = "specdec_ext.compat.sglang"
FUNCTIONS = ("tree_speculative_sampling_target_only", "verify_tree_greedy")
# Where a release binds one of the functions to another name before calling it.
ALIASES = {"sampling_fn = tree_speculative_sampling_target_only": ("sampling_fn", FUNCTIONS[0])}
KERNELS = {FUNCTIONS[0]: "sglang/kernels/ops/speculative/sampling.py",
           FUNCTIONS[1]: "sglang/kernels/ops/speculative/tree.py"}
WHEELS_FROM = "0.5.11"  # sglang publishes wheels only from here on


def sources(version: str) -> dict:
    from packaging.version import Version

    wheel = Version(version) >= Version(WHEELS_FROM)
    members = ("sglang/srt/speculative/*.py",) + (("sglang/kernels/ops/speculative/*.py",) if wheel else ())
    return {"release": Source(PROJECT, version, members, "wheel" if wheel else "sdist")}


def adapt(trees: dict, version: str, out_dir: Path) -> list:
    root = trees["release"]
    checks, called = [], set()
    for path in sorted((root / "sglang" / "srt" / "speculative").glob("*.py")) + \
            sorted((root / "sglang" / "kernels" / "ops" / "speculative").glob("*.py")):
        text = path.read_text()
        names = {getattr(n.func, "id", None) or getattr(n.func, "attr", None)
                 for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)}
        calls = [(f, f) for f in FUNCTIONS if f in names]
        calls += [alias for line, alias in ALIASES.items() if line in text and alias[0] in names]
        for callee, function in calls:
            called.add(function)
            checks.append({"kind": "call", "id": f"{path.relative_to(root)}:{callee}", "file": str(path),
                           "caller": None, "callee": callee, "shim": f"{SHIM}:{function}"})
    missing = [f for f in FUNCTIONS if f not in called]
    if missing:
        raise ValueError(f"sglang {version}: no call of {missing} in sglang/srt/speculative or "
                         "sglang/kernels/ops/speculative: the verify step's call sites moved")
    for function, name in KERNELS.items():
        if (root / name).exists():
            checks.append({"kind": "signature", "id": f"{name}:{function}", "file": str(root / name),
                           "qualname": function, "shim": f"{SHIM}:{function}", "allow": {}})
    write_conftest(out_dir)
    return contract.write_checks(out_dir, checks)


SUITE = Suite(
    name="sglang",
    project=PROJECT,
    versions=("0.5.2", "0.5.10.post1", "0.5.23"),
    sources=sources,
    adapt=adapt,
    minimum_passed=4,
    tests_from="no SGLang tests of these kernels are on PyPI: the release's call sites and kernel signatures against "
               "the shim's (contract.py)",
)

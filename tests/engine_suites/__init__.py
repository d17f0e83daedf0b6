"""The engines' own tests against specdec_ext's shims, release by release (docs/engines.md, "Version matrix").

A suite is one module of this package defining `SUITE = Suite(...)`: flashinfer.py, sglang.py, transformers.py,
vllm_v1.py and vllm_v2.py (`suites()` lists the modules of ENGINES that exist). A suite
says which PyPI releases it claims and, per release, which files to download (`sources`); `adapt` turns them into a
pytest folder, and run.run_suite runs it in a subprocess and counts the results. Nothing of an engine is committed
here: releases are downloaded from PyPI at test time (sdist.fetch, sha256-checked, cached) and adapted by code.

The interface a suite module implements:

    SUITE = Suite(
        name="flashinfer",                  # the engine, as scripts/engine_suites.py --engine takes it
        project="flashinfer-python",        # the PyPI project whose releases are claimed
        versions=("0.7.0rc3", "0.7.4"),     # the claimed releases checked, oldest first; the last is the newest
        sources=lambda version: {...},      # {label: Source(project, release, member globs, "sdist"/"wheel")}
        adapt=adapt,                        # adapt(trees {label: Path}, version, out_dir) -> pytest args
        deselected={pattern: reason},       # tests that cannot apply, by name (below); every one is reported
        budget={pattern: reason},           # tests left out for CPU time unless run with all_cases=True
        minimum_passed=100,                 # what CI requires of the newest release
        tests_from="...",                   # one line: whose tests these are and where they come from
    )

`adapt` writes a runnable pytest folder into out_dir (a conftest.py that puts stand-ins first on sys.path and points
the engine's functions at the shim, the engine's test files rewritten only where needed, generated checks) and returns
the pytest arguments, relative to out_dir (files or node ids: only the tests of the functions the shim replaces).
Helpers for it: `rewrite` (text replacements that must each apply), `write_conftest`, `note` (a line for the
result: what was left out and why), `STANDINS` (the stand-in
packages' folder) and contract.write_checks (the shim's signatures against the release's source, parsed, not run).

Patterns are fnmatch patterns over `file::function[param=value,...]` (parameters sorted by name) or over pytest's
own `file::function[id]`; a pattern that matches no test is reported (`unmatched`) so that stale ones show.
Deselect only what cannot apply: tests that assert the engine's own noise-dependent tokens (specdec_ext draws from
the same law with its own Philox streams), tests of the engine's private kernels, modes the shims refuse (lossy
modes, and the shapes or features a shim documents as refused). Everything else must pass.
"""
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Tuple

ENGINES = ("flashinfer", "sglang", "transformers", "vllm_v1", "vllm_v2")
STANDINS = Path(__file__).resolve().parent / "standins"
TESTS_DIR = Path(__file__).resolve().parent.parent  # tests/: engine_suites and helpers are importable from it


@dataclass(frozen=True)
class Source:
    """Files of one PyPI release: member globs over its source tree (an sdist's, without its top folder; a wheel's)."""
    project: str
    version: str
    members: Tuple[str, ...]
    kind: str = "sdist"


@dataclass(frozen=True)
class Suite:
    name: str
    project: str
    versions: Tuple[str, ...]
    sources: Callable[[str], Dict[str, Source]]
    adapt: Callable[[Dict[str, Path], str, Path], list]
    deselected: Dict[str, str] = field(default_factory=dict)
    budget: Dict[str, str] = field(default_factory=dict)
    minimum_passed: int = 1
    tests_from: str = ""

    @property
    def newest(self) -> str:
        return self.versions[-1]


def suites() -> Dict[str, Suite]:
    """The suites whose modules exist, by engine name, in ENGINES' order."""
    out = {}
    for name in ENGINES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            continue
        out[name] = module.SUITE
    return out


def rewrite(text: str, replacements, what: str) -> str:
    """Applies (old, new) text replacements to an engine's test file; each must apply at least once, so that a release
    whose text moved fails loudly instead of running unadapted."""
    for old, new in replacements:
        if old not in text:
            raise ValueError(f"{what}: the adaptation expects {old!r}, which this release's text lacks")
        text = text.replace(old, new)
    return text


def note(out_dir: Path, text: str) -> None:
    """A line for the run's result (`notes`): what an adaptation had to leave out, and why."""
    with open(Path(out_dir) / "notes.txt", "a") as f:
        f.write(text + "\n")


def write_conftest(out_dir: Path, paths=(), body: str = "") -> None:
    """out_dir/conftest.py: `paths` first on sys.path (stand-ins, a release's pure-Python package), then `body`."""
    lines = ['"""Written by tests/engine_suites (an adapted engine test folder)."""', "import sys", ""]
    lines += [f"sys.path.insert(0, {str(p)!r})" for p in reversed(list(paths))]
    (Path(out_dir) / "conftest.py").write_text("\n".join(lines) + "\n" + body)

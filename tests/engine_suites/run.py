"""run_suite(suite, version): one release's adapted tests in a pytest subprocess, counted from its JUnit XML.

    run_suite(SUITE, "0.7.4") -> {"engine", "project", "version", "sources", "args", "passed", "failed", "skipped",
                                  "errors", "deselected": {test: reason}, "budget": {test: reason}, "unmatched",
                                  "failures": {test: first line}, "notes": [what was left out], "seconds"}

`skipped` counts the engine's own skips and expected failures; `deselected` the suite's, `budget` the tests left out
for CPU time (all_cases=True runs them). The subprocess runs the native kernels (not the emulator).
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import TESTS_DIR, Suite, sdist


def _count(junit: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": {}}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).name}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
                if outcome != "skipped":
                    counts["failures"][name] = (child.get("message") or "").splitlines()[0][:300] if \
                        child.get("message") else child.tag
                break
        counts[outcome] += 1
    return counts


def _lines(path: Path) -> list:
    return path.read_text().splitlines() if path.exists() else []


def run_suite(suite: Suite, version: str, all_cases: bool = False, workdir=None, timeout_s: float = 1800) -> dict:
    """Downloads what the suite needs for `version`, adapts it into a pytest folder (under workdir, or a temporary
    one) and runs it in a subprocess. A failure to fetch or adapt raises; test failures are counted."""
    start = time.monotonic()
    trees = {label: sdist.fetch(s.project, s.version, s.members, s.kind) for label, s in suite.sources(version).items()}
    out_dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"engine-{suite.name}-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("notes.txt", "selection_report.json", "junit.xml"):
        (out_dir / stale).unlink(missing_ok=True)
    args = suite.adapt(trees, version, out_dir)
    (out_dir / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    report, junit = out_dir / "selection_report.json", out_dir / "junit.xml"
    selection = out_dir / "selection.json"
    selection.write_text(json.dumps({"deselected": suite.deselected, "budget": {} if all_cases else suite.budget,
                                     "report": str(report)}, indent=1))
    env = dict(os.environ, SPECDEC_ENGINE_SELECTION=str(selection),
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-c", str(out_dir / "pytest.ini"), "--rootdir", str(out_dir),
           "-p", "engine_suites.plugin", "-p", "no:xdist", "-q", "-rfE", f"--junitxml={junit}", *args]
    proc = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True, timeout=timeout_s)
    (out_dir / "pytest.log").write_text(proc.stdout + proc.stderr)
    if not junit.exists():
        raise RuntimeError(f"{suite.name} {version}: pytest wrote no results (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    counts = _count(junit)
    selected = json.loads(report.read_text()) if report.exists() else {"deselected": {}, "budget": {},
                                                                        "unmatched": []}
    if proc.returncode not in (0, 1) and not counts["errors"] + counts["failed"]:
        counts["errors"] += 1  # an interrupted or crashed session (exit 2..5) without a failing test in the XML
        counts["failures"]["pytest"] = f"exit status {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}"
    return {"engine": suite.name, "project": suite.project, "version": version,
            "sources": {label: sdist.source(tree) for label, tree in trees.items()}, "tests_from": suite.tests_from,
            "args": list(args), "passed": counts["passed"], "failed": counts["failed"], "skipped": counts["skipped"],
            "errors": counts["errors"], "deselected": selected["deselected"], "budget": selected["budget"],
            "unmatched": selected["unmatched"], "failures": counts["failures"],
            "notes": _lines(out_dir / "notes.txt"), "log": str(out_dir / "pytest.log"),
            "seconds": round(time.monotonic() - start, 1)}

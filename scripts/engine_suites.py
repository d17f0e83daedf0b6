#!/usr/bin/env python3
"""The version matrix: each engine's own tests (where its releases ship them) and each claimed release's contract,
against specdec_ext's shims (tests/engine_suites, docs/engines.md "Version matrix").

    .venv/bin/python scripts/engine_suites.py                     # every claimed release of every engine
    .venv/bin/python scripts/engine_suites.py --newest            # the newest claimed release of each engine
    .venv/bin/python scripts/engine_suites.py --engine flashinfer --version 0.7.4
    .venv/bin/python scripts/engine_suites.py --all-cases         # also the tests left out for CPU time

Writes bench/results/engine_suites.json (--out to change): per engine and release, what ran (the files and their
sha256), passed / failed / skipped / errors, the deselected and budget-excluded tests with their reasons. A rerun
of part of the matrix updates those entries and keeps the others. Exit status 1 when a check failed.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from engine_suites import suites  # noqa: E402
from engine_suites.run import run_suite  # noqa: E402


def _summary(result: dict) -> dict:
    """The JSON entry: counts, reasons grouped (test names under each reason), failures."""
    out = {k: result[k] for k in ("project", "version", "tests_from", "sources", "args", "passed", "failed",
                                  "skipped", "errors", "failures", "unmatched", "notes")}
    for group in ("deselected", "budget"):
        by_reason = {}
        for test, reason in sorted(result[group].items()):
            by_reason.setdefault(reason, []).append(test)
        out[group] = {"count": len(result[group]), "by_reason": by_reason}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", help="an engine (repeatable); default: all")
    parser.add_argument("--version", help="one release of the engine given (default: every claimed release)")
    parser.add_argument("--newest", action="store_true", help="only the newest claimed release of each engine")
    parser.add_argument("--all-cases", action="store_true", help="also run the tests left out for CPU time")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_suites.json"))
    args = parser.parse_args()
    available = suites()
    engines = args.engine or list(available)
    unknown = [e for e in engines if e not in available]
    if unknown:
        parser.error(f"unknown engine {unknown}; known: {list(available)}")
    if args.version and len(engines) != 1:
        parser.error("--version needs exactly one --engine")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    ok = True
    for name in engines:
        suite = available[name]
        versions = [args.version] if args.version else [suite.newest] if args.newest else list(suite.versions)
        for version in versions:
            result = run_suite(suite, version, all_cases=args.all_cases)
            results.setdefault(name, {})[version] = _summary(result)
            ok &= not (result["failed"] or result["errors"])
            print(f"{name} {version}: {result['passed']} passed, {result['failed']} failed, {result['errors']} errors, "
                  f"{result['skipped']} skipped, {len(result['deselected'])} deselected, {len(result['budget'])} "
                  f"left out for CPU time ({result['seconds']} s)")
            for test, message in result["failures"].items():
                print(f"  FAILED {test}: {message}")
            for line in result["notes"]:
                print(f"  note: {line}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

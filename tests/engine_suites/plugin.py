"""pytest plugin of an engine suite's subprocess (run.py loads it with -p): removes the tests that the suite
deselects by name (and those over its CPU budget) and writes which, with their reasons, to a JSON report.

$SPECDEC_ENGINE_SELECTION names a JSON file {"deselected": {pattern: reason}, "budget": {pattern: reason},
"report": path}; the report gets {"deselected": {test: reason}, "budget": {test: reason}, "unmatched": [patterns]}.
"""
import fnmatch
import json
import os


def named_id(item) -> str:
    """file::function[param=value,...], parameters sorted by name (the function alone when not parametrized)."""
    base = f"{item.path.name}::{getattr(item, 'originalname', None) or item.name}"
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return base
    return base + "[" + ",".join(f"{k}={v}" for k, v in sorted(callspec.params.items())) + "]"


def _match(patterns: dict, names) -> str:
    for pattern in patterns:
        glob = pattern.replace("[", "[[]")  # brackets are the test id's, not fnmatch's character sets
        if any(fnmatch.fnmatchcase(n, glob) for n in names):
            return pattern
    return None


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("SPECDEC_ENGINE_SELECTION")
    if not path:
        return
    with open(path) as f:
        selection = json.load(f)
    report = {"deselected": {}, "budget": {}, "unmatched": []}
    used, kept, removed = set(), [], []
    for item in items:
        names = (named_id(item), f"{item.path.name}::{item.name}")
        for group in ("deselected", "budget"):
            pattern = _match(selection[group], names)
            if pattern is not None:
                used.add(pattern)
                report[group][f"{item.path.name}::{item.name}"] = selection[group][pattern]
                removed.append(item)
                break
        else:
            kept.append(item)
    report["unmatched"] = sorted(p for g in ("deselected", "budget") for p in selection[g] if p not in used)
    if removed:
        config.hook.pytest_deselected(items=removed)
        items[:] = kept
    with open(selection["report"], "w") as f:
        json.dump(report, f, indent=1)

"""The newest claimed release of each engine, against its shim (tests/engine_suites; the whole matrix is
scripts/engine_suites.py): FlashInfer's and vLLM's own tests and each release's contract, downloaded from PyPI at test
time."""
import pytest
from engine_suites import suites
from engine_suites.run import run_suite
from packaging.version import Version

SUITES = suites()


@pytest.mark.parametrize("suite", list(SUITES.values()), ids=[f"{s.name}-{s.newest}" for s in SUITES.values()])
def test_newest_release(suite, tmp_path):
    result = run_suite(suite, suite.newest, workdir=tmp_path)
    print(f"{suite.name} {suite.newest} ({suite.tests_from}): {result['passed']} passed, {result['skipped']} skipped, "
          f"{len(result['deselected'])} deselected, {len(result['budget'])} left out for CPU time")
    for reason in sorted(set(result["deselected"].values())):
        print(f"  deselected: {reason}")
    for line in result["notes"]:
        print(f"  note: {line}")
    assert not result["failures"], f"{suite.name} {suite.newest}: {result['failures']} (log: {result['log']})"
    assert result["failed"] == 0 and result["errors"] == 0
    assert result["passed"] >= suite.minimum_passed, (suite.name, suite.newest, result["passed"])
    assert not result["unmatched"], f"stale deselection patterns: {result['unmatched']}"


def test_every_engine_has_a_suite():
    assert {"flashinfer", "sglang", "transformers", "vllm_v1", "vllm_v2"} <= set(SUITES)
    for suite in SUITES.values():
        assert list(suite.versions) == sorted(suite.versions, key=Version), suite.name  # oldest first

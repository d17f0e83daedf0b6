"""Every public op documents itself in numpy style (a one-line summary, Parameters, Returns, Examples) and its
examples run: the doctests of specdec_ext.ops run here on the CPU, and an op whose docstring loses a section or its
examples fails."""
import doctest
import inspect
import re

import pytest

from specdec_ext import ops

PUBLIC_OPS = ("philox_uniform", "chain_speculative_sampling", "chain_speculative_sampling_from_logits",
              "tree_speculative_sampling", "tree_speculative_sampling_from_logits", "sample_without_drafts",
              "gumbel_sample", "verify_attention", "truncate_kv_cache", "skinny_linear", "quantized_linear",
              "dequantize", "rms_norm", "add_rms_norm", "rotary_split", "silu_mul")
SECTIONS = ("Parameters", "Returns", "Examples")


def docstring_line(fn) -> int:
    """The line of fn's docstring in specdec_ext/ops.py (a module-level op bound from Ops: the method's)."""
    return doctest.DocTestFinder(exclude_empty=False).find(fn, fn.__name__, module=ops)[0].lineno


@pytest.fixture(scope="module")
def doctest_results() -> dict:
    """{docstring line: (name, examples run, failures, the failure report)} of every doctest of specdec_ext.ops,
    each docstring run once (the module's ops bound from Ops share the methods' docstrings)."""
    runner, results = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS), {}
    for test in sorted(doctest.DocTestFinder().find(ops), key=lambda t: t.name):
        if test.examples and test.lineno not in results:
            report = []
            failed, attempted = runner.run(test, out=report.append)
            results[test.lineno] = (test.name, attempted, failed, "".join(report))
    return results


def test_every_doctest_of_ops_passes(doctest_results):
    failures = [report for name, attempted, failed, report in doctest_results.values() if failed]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", PUBLIC_OPS)
def test_op_docstring_has_its_sections_and_an_example_that_ran(name, doctest_results):
    fn = getattr(ops, name)
    doc = inspect.getdoc(fn)
    assert doc and "\n" not in doc.split("\n\n")[0], f"{name}: the docstring must open with a one-line summary"
    for section in SECTIONS:
        assert re.search(rf"^{section}\n-{{{len(section)}}}$", doc, re.MULTILINE), f"{name}: no {section} section"
    line = docstring_line(fn)
    assert line in doctest_results, f"{name}: its Examples hold no doctest"
    test_name, attempted, failed, report = doctest_results[line]
    assert attempted > 0 and not failed, f"{name} ({test_name}): {failed} of {attempted} examples failed\n{report}"

"""The documentation keeps up with the code: every op registered under torch.ops.specdec (and every public Python op)
has a section in docs/ops.md that names each of its arguments, every repository path docs/ops.md quotes exists, and
every relative Markdown link in README.md and docs/*.md resolves (file and #anchor). Fast: nothing is run but an
import of specdec_ext."""
import inspect
import re
from pathlib import Path

import pytest
import torch

import specdec_ext

ROOT = Path(__file__).resolve().parent.parent
OPS_DOC = ROOT / "docs" / "ops.md"

# The ops this reference must cover at least; the schema test also picks up any op registered later.
KNOWN_SCHEMAS = {"philox_uniform", "chain_speculative_sampling", "chain_speculative_sampling_from_logits",
                 "tree_speculative_sampling", "tree_speculative_sampling_from_logits", "verify_attention",
                 "truncate_kv_cache", "skinny_linear", "quantized_linear", "dequantize", "rms_norm", "add_rms_norm",
                 "rotary_split", "silu_mul"}
# Public Python ops without a schema of their own: gumbel_sample calls chain_speculative_sampling_from_logits,
# set_strict is a switch of the wrappers.
PYTHON_ONLY_OPS = {"gumbel_sample", "sample_without_drafts", "set_strict"}
# Schema arguments that a section need not name: error_flags is the device-side error word that the Python wrappers
# allocate in strict mode and read back; no caller passes it (the conventions section describes it once).
UNDOCUMENTED_ARGUMENTS = {"error_flags"}
# Python parameters that a section need not name: `self` of the bound methods of specdec_ext.ops.Ops.
UNDOCUMENTED_PARAMETERS = {"self"}

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_REPO_PREFIXES = ("csrc/", "specdec_ext/", "tests/", "bench/", "scripts/", "docs/")


def _without_fences(text: str) -> str:
    """The text with its fenced code blocks blanked (line count kept), so that code is not read as Markdown."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def specdec_schemas() -> dict:
    """{op name: [argument names]} of every schema registered under torch.ops.specdec. torch.ops.specdec's dir()
    lists only the ops already looked up, so the schemas come from the dispatcher's registry instead."""
    return {s.name.split("::", 1)[1]: [a.name for a in s.arguments]
            for s in torch._C._jit_get_all_schemas() if s.name.startswith("specdec::")}


def sections(text: str) -> dict:
    """{heading text: body} of the level-2 sections (`## name`) of a Markdown text, code blocks included in the
    bodies; a section runs to the next level-1 or level-2 heading."""
    out, name, body = {}, None, []
    for line, plain in zip(text.splitlines(), _without_fences(text).splitlines() + [""] * text.count("\n")):
        heading = re.match(r"#{1,2} (.*)", plain)
        if heading:
            if name is not None:
                out[name] = "\n".join(body)
            name, body = (heading.group(1).strip().strip("`") if plain.startswith("## ") else None), []
        elif name is not None:
            body.append(line)
    if name is not None:
        out[name] = "\n".join(body)
    return out


def _mentions(section: str, word: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", section) is not None


def schema_doc_problems(doc: str, schemas: dict) -> list:
    """What docs/ops.md misses of `schemas` ({op: [argument names]}): an op without a `## op` section, or an
    argument its section does not name."""
    secs, problems = sections(doc), []
    for op, args in sorted(schemas.items()):
        if op not in secs:
            problems.append(f"{op}: no '## {op}' section")
            continue
        problems += [f"{op}: argument {a!r} not named in its section" for a in args
                     if a not in UNDOCUMENTED_ARGUMENTS and not _mentions(secs[op], a)]
    return problems


def python_ops() -> dict:
    """{name: [parameter names]} of the public Python ops: those with a schema wrapped in specdec_ext.ops, and the
    Python-only ones."""
    out = {}
    for name in sorted(KNOWN_SCHEMAS | PYTHON_ONLY_OPS):
        fn = getattr(specdec_ext.ops, name, None)
        if fn is not None:
            out[name] = [p for p in inspect.signature(fn).parameters if p not in UNDOCUMENTED_PARAMETERS]
    return out


def repo_paths(doc: str) -> list:
    """The code spans of a Markdown text (fenced blocks left out) that look like repository paths."""
    out = []
    for span in _CODE_SPAN.findall(_without_fences(doc)):
        span = span.strip()
        if " " in span or "*" in span or "$" in span:
            continue
        if span.startswith(_REPO_PREFIXES) or ("/" in span and re.search(r"\.[A-Za-z][A-Za-z0-9]*$", span)):
            out.append(span)
    return out


def missing_paths(doc: str, root: Path = ROOT) -> list:
    return sorted({p for p in repo_paths(doc) if not (root / p).exists()})


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text (links and code spans reduced to their text), lowercased,
    every character that is not a letter, digit, underscore, hyphen or space dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set:
    """The anchors of the headings of a Markdown file; a repeated slug gets -1, -2, ... as on GitHub."""
    seen, out = {}, set()
    for line in _without_fences(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# Reference-style link definitions: "[name]: target" at the start of a line; uses: "[text][name]".
_LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?", re.M)
_LINK_LABEL = re.compile(r"^ {0,3}\[([^\]]+)\]:", re.M)
_LINK_USE = re.compile(r"\]\[([^\]]+)\]")


def broken_links(path: Path, root: Path = ROOT) -> list:
    """The relative links of a Markdown file (no scheme; fenced code and code spans left out) whose file does not
    exist, or whose #anchor into a Markdown file names no heading there."""
    text = _CODE_SPAN.sub("", _without_fences(path.read_text(encoding="utf-8")))
    problems = []
    for target in _LINK.findall(text) + _LINK_DEFINITION.findall(text):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # https:, mailto:, ...
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    labels = [label.lower() for label in _LINK_LABEL.findall(text)]
    for label in sorted({label for label in labels if labels.count(label) > 1}):
        problems.append(f"{path.relative_to(root)}: [{label}] is defined twice (the first definition wins)")
    for label in sorted({label.lower() for label in _LINK_USE.findall(text)} - set(labels)):
        problems.append(f"{path.relative_to(root)}: [{label}] is used but never defined")
    return list(dict.fromkeys(problems))  # each broken target once


def test_schemas_are_listed():
    schemas = specdec_schemas()
    assert KNOWN_SCHEMAS <= set(schemas), f"not registered: {sorted(KNOWN_SCHEMAS - set(schemas))}"
    assert all(args for args in schemas.values())


def test_every_schema_and_argument_is_documented():
    problems = schema_doc_problems(OPS_DOC.read_text(encoding="utf-8"), specdec_schemas())
    assert not problems, "docs/ops.md misses:\n" + "\n".join(problems)


def test_every_python_op_and_parameter_is_documented():
    ops = python_ops()
    assert PYTHON_ONLY_OPS <= set(ops)
    problems = schema_doc_problems(OPS_DOC.read_text(encoding="utf-8"), ops)
    assert not problems, "docs/ops.md misses:\n" + "\n".join(problems)


def test_op_index_links_every_section():
    doc = OPS_DOC.read_text(encoding="utf-8")
    for op in sorted(set(specdec_schemas()) | PYTHON_ONLY_OPS):
        assert f"(#{github_slug(op)})" in doc, f"docs/ops.md's index has no link to #{github_slug(op)}"


def test_repo_paths_in_ops_doc_exist():
    doc = OPS_DOC.read_text(encoding="utf-8")
    assert len(repo_paths(doc)) > 20  # the file tables are read
    missing = missing_paths(doc)
    assert not missing, "docs/ops.md names paths that do not exist:\n" + "\n".join(missing)


MARKDOWN_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_lines_fit(path):
    long = [i for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 120]
    assert not long, f"{path.relative_to(ROOT)}: lines longer than 120 characters: {long}"


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_github_slug():
    assert github_slug("Limits and layouts") == "limits-and-layouts"
    assert github_slug("`chain_speculative_sampling`") == "chain_speculative_sampling"
    assert github_slug("Top-k, top-p, min-p inside the sampling ops") == "top-k-top-p-min-p-inside-the-sampling-ops"
    assert github_slug("Verify attention: what the kernels compute") == "verify-attention-what-the-kernels-compute"

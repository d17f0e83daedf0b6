"""The benchmarks' command line and their records: `specdec bench` has one sub-parser per benchmark (its own flags,
its former names as aliases), every benchmark command written in the documents and in bench/gpu_check.sh parses,
the kernel benchmarks run at tiny sizes on the CPU, and every file bench/RESULTS.md and bench/history/ name exists
(and every file of bench/results/ and bench/history/ is named by one of them)."""
import argparse
import contextlib
import fnmatch
import io
import itertools
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from test_docs import broken_links, repo_paths

import specdec_ext.bench as benchmarks
from specdec_ext.bench import common, e2e
from specdec_ext.cli.bench import register

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
HISTORY = ROOT / "bench" / "history"
GPU_CHECK = ROOT / "bench" / "gpu_check.sh"


def result_notes() -> list:
    return [RESULTS] + sorted(HISTORY.glob("*.md"))


def documents() -> list:
    """Every document that may quote a `specdec bench` command."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + result_notes()


@pytest.fixture(scope="module")
def parser():
    parser = argparse.ArgumentParser(prog="specdec")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def parse(parser, argv):
    """parser.parse_args(argv), or the usage error's message as a SystemExit."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit as e:
            raise SystemExit(err.getvalue().strip().splitlines()[-1] if err.getvalue() else e.code) from None


def test_every_benchmark_and_alias_is_a_subcommand(parser):
    for name, aliases in benchmarks.BENCHMARKS.items():
        module = benchmarks.module(name)
        assert module.__name__ == f"specdec_ext.bench.{name}"
        assert callable(module.add_arguments) and callable(module.main)
        assert module.__doc__.split("\n", 1)[0].strip(), f"{name}: its docstring's first line is its help"
        for spelling in (name, *aliases):
            args = parse(parser, ["bench", spelling])
            assert args.command == "bench" and args.benchmark == spelling
            assert benchmarks.module(args.benchmark) is module
    assert set(benchmarks.ALIASES) == {"sampling", "flat_sampling", "row_filters", "philox", "attention"}
    with pytest.raises(ValueError, match="no benchmark 'nosuch'"):
        benchmarks.module("nosuch")


def test_run_dispatches_an_alias_to_its_module(parser, monkeypatch):
    seen = []
    monkeypatch.setattr(benchmarks.module("verify_attention"), "main", lambda args: seen.append(args) or 7)
    args = parse(parser, ["bench", "attention", "--contexts", "64", "--queries", "2"])
    assert args.fn(args) == 7 and seen == [args]


def test_each_benchmark_has_its_own_flags(parser):
    args = parse(parser, ["bench", "verify_attention", "--batch", "1,8", "--contexts", "512,4096", "--queries", "5",
                          "--flex"])
    assert (args.batch, args.contexts, args.queries, args.flex, args.layouts) == ([1, 8], [512, 4096], [5], True, False)
    args = parse(parser, ["bench", "tree_sampling", "--nodes", "8,32"])
    assert (args.batch, args.nodes, args.vocab) == ([1, 8, 64], [8, 32], [49152])
    assert parse(parser, ["bench", "quantized_linear", "--rows", "1,4"]).rows == [1, 4]
    assert parse(parser, ["bench", "compat_sglang", "--nodes", "4"]).nodes == [4]
    args = parse(parser, ["bench", "chain_sampling", "--k", "1,4", "--vocab", "32000"])
    assert (args.batch, args.k, args.vocab, args.repeats) == ([1, 8, 64], [1, 4], [32000], 50)
    assert parse(parser, ["bench", "flat_sampling", "--k", "8"]).k == 8  # the largest draft count
    # The flags' former meanings are gone: --vocab was attention's contexts, --k its queries and the tree nodes.
    for argv in (["attention", "--vocab", "4096"], ["attention", "--k", "5"], ["tree_sampling", "--k", "8"],
                 ["quantized_linear", "--batch", "4"], ["compat_sglang", "--k", "4"]):
        with pytest.raises(SystemExit, match="unrecognized arguments"):
            parse(parser, ["bench", *argv])


def test_common_flags_and_their_defaults(parser):
    for name in benchmarks.BENCHMARKS:
        args = parse(parser, ["bench", name, "--repeats", "3", "--json", "out.json"])
        assert (args.repeats, args.json, args.device) == (3, "out.json", None)
    assert parse(parser, ["bench", "e2e"]).repeats == 3
    assert parse(parser, ["bench", "cpu_forward"]).repeats == 20
    assert parse(parser, ["bench", "philox"]).repeats == 50
    assert parse(parser, ["bench", "cpu_forward", "--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit, match="invalid choice: 'cuda'"):  # the CPU path only
        parse(parser, ["bench", "cpu_forward", "--device", "cuda"])
    # e2e: the shipped model's rows on the CPU only, a synthetic target's on either
    with pytest.raises(SystemExit, match="run on the CPU"):
        e2e.main(parse(parser, ["bench", "e2e", "--device", "cuda"]))
    args = parse(parser, ["bench", "e2e", "--device", "cuda", "--target", "synthetic:llama-3.1-8b"])
    assert (args.device, args.target, args.oracle_acceptance, args.cuda_graphs) == \
        ("cuda", "synthetic:llama-3.1-8b", "0.8", "on")
    with pytest.raises(SystemExit, match="unrecognized arguments: --plot"):  # its rows have no speed-up to draw
        parse(parser, ["bench", "cpu_forward", "--plot", "out.png"])


@pytest.mark.parametrize("value,message", [("abc", "is not a comma-separated list of integers"),
                                           ("1,,2", "is not a comma-separated list of integers"),
                                           ("0,8", "every value must be >= 1")])
def test_list_flags_refuse_what_is_not_a_list_of_sizes(parser, value, message):
    with pytest.raises(SystemExit, match=f"argument --batch: .*{message}"):
        parse(parser, ["bench", "chain_sampling", "--batch", value])


# The kernel benchmarks at tiny sizes on the CPU: each runs its grid and writes its rows.
TINY = {
    "chain_sampling": ["--batch", "1,2", "--k", "2", "--vocab", "64"],
    "chain_sampling_flat": ["--batch", "3", "--k", "2", "--vocab", "64"],
    "chain_sampling_row_filters": ["--batch", "2", "--k", "2", "--vocab", "64"],
    "philox_uniform": ["--batch", "1,2", "--uniforms", "64"],
    "tree_sampling": ["--batch", "1", "--nodes", "4", "--vocab", "64", "--dtype", "float32"],
    "verify_attention": ["--batch", "1", "--contexts", "64", "--queries", "2"],
    "compat_flashinfer": ["--batch", "1", "--k", "2", "--vocab", "64"],
    "compat_sglang": ["--batch", "2", "--nodes", "4", "--vocab", "64"],
    "compat_vllm": ["--batch", "2", "--k", "2", "--vocab", "64"],
    "compat_vllm_v2": ["--batch", "2", "--k", "2", "--vocab", "64"],
}
TINY_ROWS = {"chain_sampling": 12, "chain_sampling_flat": 4, "chain_sampling_row_filters": 2, "philox_uniform": 2,
             "tree_sampling": 2, "verify_attention": 1, "compat_flashinfer": 1, "compat_sglang": 1, "compat_vllm": 2,
             "compat_vllm_v2": 1}


@pytest.mark.parametrize("name", sorted(TINY))
def test_kernel_benchmarks_run_at_tiny_sizes(name, parser, tmp_path, monkeypatch, capsys):
    module = benchmarks.module(name)
    if hasattr(module, "copy_bandwidth_gbs"):  # a 256 MB copy measured per run: the ratios do not need it here
        monkeypatch.setattr(module, "copy_bandwidth_gbs", lambda device: 10.0)
    out = tmp_path / "rows.json"
    args = parse(parser, ["bench", name, *TINY[name], "--device", "cpu", "--repeats", "1", "--json", str(out)])
    assert args.fn(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == TINY_ROWS[name], rows
    assert all(row.get("speedup", 1) > 0 for row in rows)
    assert f"wrote {out}" in capsys.readouterr().out


def test_chain_sampling_against_flashinfer(parser, tmp_path, monkeypatch, capsys):
    """--against flashinfer: without flashinfer the run says so and has no FlashInfer column; with a flashinfer whose
    chain_speculative_sampling is this library's FlashInfer shim (same signature), each float32 probabilities row
    times it on the row's own inputs and reports the ratio; other rows have NaN."""
    import math
    import sys
    import types

    from specdec_ext.compat.flashinfer import sampling as shim

    module = benchmarks.module("chain_sampling")
    monkeypatch.setattr(module, "copy_bandwidth_gbs", lambda device: 10.0)
    argv = ["bench", "chain_sampling", *TINY["chain_sampling"], "--device", "cpu", "--repeats", "1",
            "--against", "flashinfer", "--json", str(tmp_path / "rows.json")]
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not importable
    args = parse(parser, argv)
    assert args.fn(args) == 0
    assert "flashinfer does not import here" in capsys.readouterr().out
    assert all("flashinfer_us" not in r for r in json.loads((tmp_path / "rows.json").read_text())["rows"])

    calls = []
    package = types.ModuleType("flashinfer")
    package.sampling = types.SimpleNamespace(chain_speculative_sampling=lambda *a, **kw: calls.append(a[1].shape) or
                                             shim.chain_speculative_sampling(*a, **kw))
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", package.sampling)
    assert args.fn(args) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    for r in rows:
        timed = r["path"] == "probs" and r["dtype"] == "float32"
        assert math.isfinite(r["flashinfer_us"]) == timed, r
        if timed:
            assert r["vs_flashinfer"] == pytest.approx(r["flashinfer_us"] / r["graph_us"])
        assert r["floor_us"] == pytest.approx(r["bytes"] / 10e9 * 1e6)
    assert {tuple(s) for s in calls} == {(1, 2), (2, 2)}  # each B's own [B, K] draft ids


def test_verify_attention_rows_state_bytes_floor_and_split_plan(parser, tmp_path, monkeypatch, capsys):
    """Each verify_attention row has the bytes that must move (K and V of context + Q tokens, q and out), their time
    at the copy bandwidth, and the CUDA kernel's split plan; --against flashinfer on the CPU says why it has no
    column."""
    module = benchmarks.module("verify_attention")
    monkeypatch.setattr(module, "copy_bandwidth_gbs", lambda device: 10.0)
    out = tmp_path / "rows.json"
    args = parse(parser, ["bench", "verify_attention", "--batch", "1", "--contexts", "300", "--queries", "1,5",
                          "--device", "cpu", "--repeats", "1", "--against", "flashinfer", "--json", str(out)])
    assert args.fn(args) == 0
    assert "need a GPU; no FlashInfer column" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    for r, n_q in zip(rows, (1, 5)):
        assert r["bytes"] == (2 * (300 + n_q) * 8 + 2 * n_q * 32) * 128 * 4  # float32 on the CPU
        assert r["floor_us"] == pytest.approx(r["bytes"] / 10e9 * 1e6)
        assert r["plan"] == "256x2, 16 blocks"  # 305 keys at 256 a split; 8 KV heads; 4 or 20 rows: one row tile
        assert "flashinfer_us" not in r


def test_draft_heads_rows(parser, tmp_path):
    """The shipped heads on 2 held-out chat prompts, 8 tokens: a greedy row equals plain decoding's tokens, its
    acceptance is a mean acceptance length, its speed-up the ratio of the two rates."""
    out = tmp_path / "heads.json"
    args = parse(parser, ["bench", "draft_heads", "--prompts", "2", "--new-tokens", "8", "--weights", "kept-Q4_1",
                          "--heads", "eagle,medusa", "--shapes", "chain k=4,tree", "--sampling", "greedy,sampled",
                          "--repeats", "1", "--json", str(out)])
    assert args.fn(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["head"], r["shape"], r["sampling"]) for r in rows] == [
        (h, s, m) for m in ("greedy", "sampled") for h in ("eagle", "medusa") for s in ("chain k=4", "tree")]
    for r in rows:
        assert r["same_as_plain"] is True if r["sampling"] == "greedy" else r["same_as_plain"] == "-"
        assert 1.0 <= r["mean_acceptance_length"] <= 5.0
        assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["plain_tok_s"])
    with pytest.raises(ValueError, match="--shapes"):
        benchmarks.module("draft_heads").main(parse(parser, ["bench", "draft_heads", "--shapes", "star"]))


def test_verify_attention_layouts_run_at_tiny_sizes(parser, tmp_path):
    out = tmp_path / "layouts.json"
    args = parse(parser, ["bench", "attention", "--layouts", "--batch", "2", "--contexts", "32", "--device", "cpu",
                          "--repeats", "1", "--json", str(out)])
    assert args.fn(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and rows[0]["vs_baseline"] == 1.0


_BENCH_COMMAND = re.compile(r"specdec(?:\.cli)? bench ((?:[^`\n\\]|\\\n)*)")


def written_commands(text: str) -> list:
    """The `specdec bench ...` commands of a text as argument lists (continuation lines joined; a trailing comment,
    `; done` or the like cut off; `…` standing for a file name). Synopses with [optional] parts or a placeholder for
    the name (`NAME`, `compat_$s`) are not commands."""
    out = []
    for match in _BENCH_COMMAND.finditer(text):
        line = re.split(r"\s#|;", match.group(1).replace("\\\n", " "))[0].replace("…", "F")
        if "[" in line or re.search(r"[A-Z$]", line.split()[0]):
            continue
        out.append(shlex.split(line))
    return out


def test_written_bench_commands_parse(parser):
    problems, count = [], 0
    for path in documents():
        for argv in written_commands(path.read_text(encoding="utf-8")):
            count += 1
            try:
                parse(parser, ["bench", *argv])
            except SystemExit as e:
                problems.append(f"{path.relative_to(ROOT)}: specdec bench {' '.join(argv)}: {e}")
    assert count > 20  # the commands are found
    assert not problems, "\n".join(problems)


def gpu_check_commands() -> list:
    """`specdec bench` argument lists of bench/gpu_check.sh's `bench NAME LIMIT ARGS...` steps (its shell function
    strips a -suffix off NAME, which names the step only, and adds --device cuda)."""
    text = GPU_CHECK.read_text().replace("\\\n", " ")  # continuation lines joined
    # The variables of the GPU branch (the first assignments of E2E_*), as the script sets them on CUDA.
    variables = dict(re.findall(r"(E2E_\w+)=(\S+)", next(line for line in text.splitlines() if "E2E_TARGET=" in line)))
    out = []
    for line in text.splitlines():
        if re.match(r"\s*(TAIL=\d+ )?bench \S+ \d+", line):
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            words = shlex.split(line, comments=True)
            words = words[1:] if words[0].startswith("TAIL=") else words
            name = words[1].replace("$shim", "flashinfer").split("-")[0]
            out.append([name, "--device", "cuda", *words[3:]])
    return out


def test_gpu_check_is_valid_bash_and_its_bench_steps_parse(parser):
    r = subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    commands = gpu_check_commands()
    assert len(commands) >= 10
    for argv in commands:
        args = parse(parser, ["bench", *[a.replace("$OUT", "out") for a in argv]])
        assert args.device == "cuda"
    e2e_steps = [c for c in commands if c[0] == "e2e"]
    assert len(e2e_steps) == 2 and e2e_steps[0][e2e_steps[0].index("--target") + 1] == "synthetic:llama-3.1-8b"


def expand_braces(name: str) -> list:
    """A shell {a,b} pattern's names: x_{a,b}.json -> [x_a.json, x_b.json]."""
    parts = re.split(r"\{([^}]*)\}", name)
    return ["".join(sum(zip(parts[::2], (*choice, "")), ()))
            for choice in itertools.product(*[p.split(",") for p in parts[1::2]])]


def test_result_notes_name_only_files_that_exist():
    for path in result_notes():
        paths = [p for span in repo_paths(path.read_text(encoding="utf-8")) if "<" not in span
                 for p in expand_braces(span)]
        assert not [p for p in paths if not (ROOT / p).exists()], path
        assert not broken_links(path), path


def named_files(text: str) -> set:
    """Every bench/results/ or bench/history/ file a text names (fenced blocks included), {a,b} expanded; a name
    built by the shell ($s) or a placeholder (<benchmark>) is none."""
    names = set()
    for match in re.finditer(r"bench/(?:results|history)/[\w.{},*…-]+", text):
        if text[match.end():match.end() + 1] in ("$", "<") or text[match.start() - 1] == "<":
            continue
        names.update(expand_braces(match.group(0).rstrip(".,")))
    return names


def test_every_result_file_is_named_and_every_named_file_exists():
    names = set().union(*(named_files(p.read_text(encoding="utf-8")) for p in result_notes()))
    concrete = {n for n in names if "*" not in n and "…" not in n}
    assert not [n for n in concrete if not (ROOT / n).exists()], sorted(n for n in concrete if not (ROOT / n).exists())
    files = [p.relative_to(ROOT).as_posix() for folder in ("results", "history")
             for p in (ROOT / "bench" / folder).iterdir() if p.suffix != ".md"]
    unnamed = [f for f in files if not any(fnmatch.fnmatch(f, n) for n in names)]
    assert not unnamed, f"files no note names (drop them or cite them): {unnamed}"


def test_int_list():
    assert common.int_list("1,8,64") == [1, 8, 64]
    with pytest.raises(argparse.ArgumentTypeError):
        common.int_list("1.5")

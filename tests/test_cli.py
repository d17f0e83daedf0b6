import subprocess
import sys

import torch

import specdec_ext


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specdec_ext.cli", *args], capture_output=True, text=True, timeout=600)


def test_info_reports_the_build():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    info = specdec_ext.build_info()
    assert f"specdec_ext {specdec_ext.__version__}" in r.stdout
    if info["cuda"]:
        assert f"compiled for architectures {info['cuda_archs']}" in r.stdout
        assert info["cuda_archs"]
    else:
        assert "CPU-only build" in r.stdout
    assert "emulator: present" in r.stdout
    assert "CPU kernel instruction set: " in r.stdout and "CPU kernel instruction set: none" not in r.stdout, r.stdout
    # The CPU kernels parallelise with at::parallel_for, which is serial unless the build has OpenMP.
    assert info["openmp"] and f"{torch.get_num_threads()} threads" in r.stdout


def test_demo_runs_and_checks_itself():
    r = run_cli("demo", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    check_demo_tasks(r.stdout)
    assert "bit-exact with the PyTorch reference: True" in r.stdout
    assert "demo OK" in r.stdout
    # The shipped model answered through speculative decoding, with the same tokens as plain decoding.
    answer = r.stdout.split("assistant: ", 1)[1].split("\nplain decoding", 1)[0]
    assert "paris" in answer.lower(), answer
    assert "speculative tokens equal plain greedy decoding's: True" in r.stdout
    assert "speedup" in r.stdout and "mean acceptance length" in r.stdout


def check_demo_tasks(stdout):
    # Two tasks, each drafted as the stated rule says: the chat question by the EAGLE head, rewriting a note by prompt
    # lookup; each equal to plain greedy decoding, then a table of the two.
    assert "drafter rule: an answer that reuses the prompt's text" in stdout, stdout
    assert "== task 1/2: chat (an open-ended chat question); drafter: eagle" in stdout, stdout
    assert "== task 2/2: rewrite (rewriting a note, keeping its wording); drafter: ngram" in stdout, stdout
    assert stdout.count("speculative tokens equal plain greedy decoding's: True") == 2, stdout
    table = stdout.split("\nsummary (", 1)[1].splitlines()
    assert table[1].split()[:2] == ["task", "drafter"], table
    rows = [line.split() for line in table[2:4]]
    assert [row[:2] for row in rows] == [["chat", "eagle"], ["rewrite", "ngram"]], table
    assert all(row[-1] == "True" and row[4].endswith("x") for row in rows), table


def test_import_stays_light():
    # `import specdec_ext` must not import the models, tokenizers or transformers (DESIGN §4).
    code = "import sys, specdec_ext; print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', " \
           "'tokenizers', 'gguf', 'safetensors') or m.startswith('specdec_ext.models')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_generate_drafts_with_the_shipped_eagle_head_by_default():
    r = run_cli("generate", "--device", "cpu", "--chat", "--max-new-tokens", "24", "--prompt",
                "What is the capital of France? Answer in one sentence.")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "paris" in r.stdout.lower(), r.stdout
    assert "[eagle drafter" in r.stderr and "mean acceptance length" in r.stderr, r.stderr


def test_generate_with_stop_strings_penalties_and_logprobs():
    """The answer names Paris; a stop string at "Paris" ends the output before it (the text the stream printed),
    and --logprobs prints a line per generated token (the token that completed the stop included)."""
    r = run_cli("generate", "--device", "cpu", "--chat", "--max-new-tokens", "24", "--stop", "Paris",
                "--repetition-penalty", "1.1", "--bad-words", "Lyon", "--min-tokens", "2", "--logprobs", "2",
                "--prompt", "What is the capital of France? Answer in one sentence.")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "paris" not in r.stdout.lower() and r.stdout.strip(), r.stdout
    assert "finished: stop]" in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if " rank " in line]
    assert 2 <= len(lines) < 24 and "rank 1" in lines[0], r.stderr


def test_generate_with_tree_rounds():
    r = run_cli("generate", "--device", "cpu", "--chat", "--max-new-tokens", "24", "--tree", "nodes=8,depth=4",
                "--prompt", "What is the capital of France? Answer in one sentence.")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "paris" in r.stdout.lower(), r.stdout
    assert "[eagle drafter, trees of <= 8 nodes, depth 4, branching 4" in r.stderr, r.stderr
    r = run_cli("generate", "--device", "cpu", "--tree", "nodes=8,depth=9", "--prompt", "Hi")
    assert r.returncode == 2 and "depth 9 needs at least 10 num_nodes" in r.stderr, r.stderr


# --- The command's edges: the ASan emulator, streaming text, arguments, interrupts, pipes ---------------------------
import os  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402

from specdec_ext import cli  # noqa: E402


def env_without_preload():
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}


def test_info_without_the_asan_runtime_preloaded():
    # scripts/test.sh builds the emulator with AddressSanitizer; importing it into a process that did not start with
    # the ASan runtime aborts that process (exit 1, no Python error). `specdec info` must not: it probes the emulator
    # in a child process with the runtime preloaded and says how to run it.
    r = subprocess.run([sys.executable, "-m", "specdec_ext.cli", "info"], capture_output=True, text=True, timeout=300,
                       env=env_without_preload())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "emulator: present" in r.stdout, r.stdout + r.stderr
    from specdec_ext import _extension

    if "libasan.so" in " ".join(_extension._dt_needed(_extension.sim_library())):
        assert "AddressSanitizer: yes" in r.stdout and "LD_PRELOAD=" in r.stdout, r.stdout
        # The same guard makes `import specdec_ext.sim` an ImportError there, which demo.py handles, not an abort.
        code = "from specdec_ext import sim"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=env_without_preload())
        assert r.returncode == 1 and "EmulatorNeedsASanRuntime" in r.stderr and "LD_PRELOAD=" in r.stderr, r.stderr


def test_text_stream_emits_whole_characters():
    from specdec_ext.models import default_model_path, load_tokenizer
    from specdec_ext.streaming import TextStream

    tokenizer = load_tokenizer(default_model_path())
    text = "東京は日本の首都です。🗼 富士山も美しい！😀 Streaming — café, naïve."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Decoding each round's tokens alone (what the CLI did) garbles the characters split across rounds.
    assert "\ufffd" in "".join(tokenizer.decode(ids[i:i + 2], skip_special_tokens=True) for i in range(0, len(ids), 2))
    for step in range(1, 4):
        for start in range(step):  # every alignment of the rounds on the characters
            stream, pieces = TextStream(tokenizer), []
            chunks = [ids[:start]] + [ids[i:i + step] for i in range(start, len(ids), step)]
            for chunk in chunks:
                piece = stream.push(chunk)
                assert "\ufffd" not in piece, (step, start, pieces, piece)
                pieces.append(piece)
            pieces.append(stream.flush())
            assert "".join(pieces) == text, (step, start, pieces)
    # The end of the stream, EOS included, decodes as the whole: special tokens skipped.
    stream = TextStream(tokenizer)
    assert stream.push(ids + [tokenizer.eos_token_id]) + stream.flush() == text


def test_text_stream_stays_out_of_the_light_import():
    code = "import sys, specdec_ext.cli; print('specdec_ext.streaming' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.stdout.strip() == "False", r.stdout + r.stderr


BAD_ARGUMENTS = [
    (["generate", "--prompt", "Hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompt", "Hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["generate", "--prompt", "Hi", "--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
    (["generate", "--prompt", "Hi", "--top-k", "-1"], "--top-k must be >= 0"),
    (["generate", "--prompt", "Hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "Hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "Hi", "-k", "0"], "-k must be in [1, 128]"),
    (["generate", "--prompt", "Hi", "-k", "129"], "-k must be in [1, 128]"),
    (["generate", "--prompt", "Hi", "--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["generate", "--prompt", "Hi", "--model", "/no/such/model.gguf"], "--model /no/such/model.gguf: no such file"),
    (["generate", "--prompt", "Hi", "--drafter", "eagel"],
     "--drafter must be eagle[:PATH], lookahead[:W/N/G], medusa[:PATH], model:PATH, ngram or self[:LAYERS][/N], got "
     "'eagel'"),
    (["generate", "--prompt", "Hi", "--drafter", "model:/no/such/dir"], "--drafter model:/no/such/dir: no such file"),
    (["generate", "--prompt", "Hi", "--device", "tpu"], "--device 'tpu' is not a device"),
    (["generate", "--prompt", "Hi", "--seed", str(2**64)], "--seed must fit in a signed 64-bit integer"),
    (["generate", "--prompt", "Hi", "--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
    (["generate", "--prompt", "Hi", "--min-p", "1"], "--min-p must be in [0, 1)"),
    (["generate", "--prompt", "Hi", "--logprobs", "21"], "--logprobs must be in [0, 20]"),
    (["generate", "--prompt", "Hi", "--logit-bias", "12=x"], "argument --logit-bias: expected TOKEN_ID=BIAS"),
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--prompt", "Hi", "--draft-keep-quantized"],
     "--draft-keep-quantized: the drafter must be model:PATH"),
    (["generate", "--prompt", "Hi", "--activations", "int8"], "--activations int8: needs --keep-quantized"),
    (["demo", "--device", "gpu"], "--device 'gpu' is not a device"),
    (["bench", "e2e", "--repeats", "0"], "--repeats must be >= 1"),
    (["bench", "e2e", "--draft", "head"], "--draft head: no such file or directory"),  # a path without --target
    (["bench", "e2e", "--target", "synthetic:llama-9b"], "--target must be synthetic:NAME with NAME one of"),
    (["bench", "e2e", "--target", "llama-3.1-8b"], "--target must be synthetic:NAME"),
    (["bench", "e2e", "--target", "synthetic:tiny", "--draft", "none,eagle"], "--draft with a synthetic target"),
    (["bench", "e2e", "--target", "synthetic:tiny", "--oracle-acceptance", "1.2"], "--oracle-acceptance must be in"),
    (["bench", "e2e", "--target", "synthetic:tiny", "--oracle-acceptance", "high"], "--oracle-acceptance takes"),
    (["bench", "e2e", "--target", "synthetic:tiny", "--sampling", "greedy,sampled"], "--sampling with a synthetic"),
    (["train-draft", "--kind", "eagle", "--data", __file__, "--out", "/tmp/unused", "--epochs", "0"],
     "--epochs must be >= 1"),
    (["train-draft", "--kind", "eagle", "--data", __file__, "--out", "/tmp/unused", "--lr", "inf"],
     "--lr must be a finite number > 0"),
    (["train-draft", "--kind", "eagle", "--data", "/nonexistent", "--out", "/tmp/unused"],
     "--data /nonexistent: no such file or directory"),
    (["train-draft", "--kind", "medusa", "--data", __file__, "--out", "/tmp/unused", "--features", "eagle3"],
     "--features eagle3: EAGLE heads only"),
    (["train-draft", "--kind", "eagle", "--data", __file__, "--out", "/tmp/unused", "--coverage", "1.5"],
     "--coverage must be in (0, 1]"),
    (["draft-data", "--out", "/tmp/unused", "--template-prompts", "-1"], "--template-prompts must be >= 0"),
]
if not torch.cuda.is_available():
    BAD_ARGUMENTS.append((["generate", "--prompt", "Hi", "--device", "cuda"], "--device cuda: no CUDA device"))


@pytest.fixture
def no_loading(monkeypatch):
    """Every command's loading (and running) raises: a test of checks made before it."""
    import specdec_ext.bench
    import specdec_ext.cli.draft_data
    import specdec_ext.cli.train_draft
    import specdec_ext.demo
    import specdec_ext.factory

    def no_loading(*a, **k):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(specdec_ext.factory, "load", no_loading)
    monkeypatch.setattr(specdec_ext.cli.train_draft, "main", no_loading)
    monkeypatch.setattr(specdec_ext.cli.draft_data, "main", no_loading)
    monkeypatch.setattr(specdec_ext.bench, "run", no_loading)
    monkeypatch.setattr(specdec_ext.demo, "main", no_loading)


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_arguments_are_usage_errors_before_loading(argv, message, no_loading, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"specdec {argv[0]}: error: {message}"), err


# SPECDEC_CPU_ISA is read by the CPU kernels at their first call: once only after the model was loaded. The message
# is the extension's (ops.cpu_isa), whose wording of the rest may change; what the CLI owes is its first line only.
ISA_ERROR = "SPECDEC_CPU_ISA must be avx512, avx2 or sse2"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "Hi", "--device", "cpu"], ["demo", "--device", "cpu"],
                                  ["bench", "e2e"],
                                  ["train-draft", "--kind", "eagle", "--data", __file__, "--out", "/tmp/unused"]],
                         ids=lambda v: v[0])
def test_bad_cpu_isa_is_a_usage_error_before_loading(argv, no_loading, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CPU_ISA", "bogus")
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"specdec {argv[0]}: error: {ISA_ERROR}") and last.endswith("got 'bogus'"), err
    assert err.count("SPECDEC_CPU_ISA") == 1, err  # one line: no C++ backtrace


def test_cpu_isa_error_is_cut_to_its_first_line(no_loading, monkeypatch, capsys):
    from specdec_ext import ops

    def cpu_isa():
        raise ValueError(f"{ISA_ERROR} (or unset), got 'x'\nException raised from isa_kernels at linear.cpp:102\n"
                         f"frame #0: c10::Error::Error()")

    monkeypatch.setattr(ops, "cpu_isa", cpu_isa)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "Hi", "--device", "cpu"])
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"specdec generate: error: {ISA_ERROR} (or unset), got 'x'", err
    assert "Exception raised" not in err and "frame #0" not in err, err


def test_bad_cpu_isa_in_the_environment_of_the_command():
    # `SPECDEC_CPU_ISA=bogus specdec generate ...`: refused before the model loader is called.
    env = dict(os.environ, SPECDEC_CPU_ISA="bogus")
    r = run_cli_without_loading("generate", "--prompt", "Hi", "--device", "cpu", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"specdec generate: error: {ISA_ERROR}"), r.stderr


@pytest.mark.parametrize("setting", [None, "sse2", "bogus"])
def test_info_reports_the_cpu_isa(setting, monkeypatch, capsys):
    from specdec_ext import ops
    from specdec_ext.cli import info as info_command

    monkeypatch.setattr(info_command, "emulator_line", lambda: "not probed by this test")
    if setting is None:
        monkeypatch.delenv("SPECDEC_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("SPECDEC_CPU_ISA", setting)
    if setting == "bogus":
        # The rest of the build is still reported; the ISA line and the exit status name the bad value.
        with pytest.raises(SystemExit) as e:
            cli.main(["info"])
        out, err = capsys.readouterr()
        assert e.value.code == 2, err
        assert "specdec_ext " in out and "emulator: not probed by this test" in out, out
        assert f"CPU kernel instruction set: none: {ISA_ERROR}" in out, out
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"specdec info: error: {ISA_ERROR}") and last.endswith("got 'bogus'"), err
        return
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    if setting is None:
        assert f"CPU kernel instruction set: {ops.cpu_isa()} (the best this CPU has)\n" in out, out
    else:
        assert "CPU kernel instruction set: sse2 (SPECDEC_CPU_ISA)\n" in out, out


# The CLI in a child process that first runs a hook patching the library: the tests below learn what the child did
# (loaded the model or not, reached a point) from the hook's marker lines on stderr, never from how long it took.
LOADER_CALLED = "specdec-test: the model loader was called"
NO_LOADING = f"""
import specdec_ext.factory
def load(*args, **kwargs):
    print({LOADER_CALLED!r}, file=sys.stderr, flush=True)
    sys.exit(99)
specdec_ext.factory.load = load
"""
LOADING = "specdec-test: loading the model"
BLOCK_IN_LOADING = f"""
import threading
import specdec_ext.factory
def load(*args, **kwargs):
    print({LOADING!r}, file=sys.stderr, flush=True)
    threading.Event().wait()  # a load that lasts until the test interrupts it
specdec_ext.factory.load = load
"""
STREAMING = "specdec-test: streaming"
BLOCK_IN_STREAMING = f"""
import threading
from specdec_ext import streaming
def push(self, ids):
    print({STREAMING!r}, file=sys.stderr, flush=True)
    threading.Event().wait()  # the real model is loaded and decoding; it stays in its first round until interrupted
streaming.TextStream.push = push
"""


def cli_child(hook: str, *args):
    """The command line of `specdec ARGS` run by a Python that runs `hook` first."""
    return [sys.executable, "-c", f"import sys\n{hook}\nfrom specdec_ext import cli\nsys.exit(cli.main(sys.argv[1:]))",
            *args]


def run_cli_without_loading(*args, env=None):
    r = subprocess.run(cli_child(NO_LOADING, *args), capture_output=True, text=True, timeout=600, env=env)
    assert LOADER_CALLED not in r.stderr and r.returncode != 99, r.stderr
    return r


def read_until(stream, marker: bytes, p) -> bytes:
    """The child's output up to the line holding `marker` (its readiness signal). A watchdog kills a child that hangs
    so that the read ends: a guard against a hang, not a bound on the time a step may take."""
    watchdog = threading.Timer(600, p.kill)
    watchdog.start()
    seen = b""
    try:
        for line in iter(stream.readline, b""):
            seen += line
            if marker in line:
                return seen
    finally:
        watchdog.cancel()
    raise AssertionError(f"the child ended (exit {p.wait()}) before {marker!r}: {seen.decode(errors='replace')}")


def test_bad_argument_exits_2_before_loading_without_a_traceback():
    r = run_cli_without_loading("generate", "--prompt", "Hi", "--top-p", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == ["specdec generate: error: --top-p must be in (0, 1] (1: off), got 2.0"], r.stderr


def test_unknown_sampling_mode_exits_2_naming_the_choices():
    r = run_cli("generate", "--prompt", "Hi", "--sampling", "gumbel")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    choices = "(choose from 'block', 'invariant', 'rejection')"
    assert f"argument --sampling: invalid choice: 'gumbel' {choices}" in r.stderr, r.stderr


def test_non_utf8_prompt_is_a_usage_error():
    # A prompt of bytes that are not UTF-8 ($'caf\xff' in bash) reaches Python as a lone surrogate.
    r = run_cli_without_loading("generate", "--prompt", b"caf\xff")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("specdec generate: error: --prompt is not valid UTF-8 text (byte 0xff "
                                                  "at character 3); pass UTF-8 text"), r.stderr


class FakeTokenizer:
    eos_token_id = 0

    def __call__(self, text):
        return {"input_ids": [5, 6, 7]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids if i or not skip_special_tokens)


def fake_model():
    from types import SimpleNamespace

    return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64), device=torch.device("cpu"),
                           dtype=torch.float32)


class FakeDecoder:
    """Stands in for SpeculativeDecoder in `specdec generate`: records its arguments, streams CHUNKS."""
    tree = None
    made: dict = {}
    chunks = ([1, 2], [3])

    def __init__(self, model, drafter, k, **kw):
        FakeDecoder.made = dict(kw, k=k)
        self.drafter = drafter

    def generate(self, prompts, max_new_tokens, *, tokenizer, text_stream, **kw):
        """Streams CHUNKS as the decoder does: through a StopChecker (whole characters, never past a stop)."""
        from specdec_ext import GenerationOutput, GenerationStats
        from specdec_ext.engine.stops import StopChecker

        FakeDecoder.controls = kw
        checker = StopChecker(tokenizer, kw.get("stop") or [])
        for new in self.chunks:
            checker.push(new)
            text_stream(0, checker.take_stream_text())
        checker.finish()
        text_stream(0, checker.take_stream_text())
        n = sum(len(c) for c in self.chunks)
        stats = GenerationStats(generated_tokens=n, elapsed_s=n / 6, num_drafts=1, num_draft_tokens=2,
                                num_accepted_tokens=1)
        stats.calibration_s = 0.25
        out = GenerationOutput([[i for c in self.chunks for i in c]], stats)
        out.finish_reasons = ["length"]
        return out


def test_generate_passes_batch_size_and_adaptive_and_reports_calibration(monkeypatch, capsys):
    import specdec_ext.engine
    import specdec_ext.factory

    monkeypatch.setattr(specdec_ext.factory, "load", lambda path, device, **options: (fake_model(), FakeTokenizer()))
    monkeypatch.setattr(specdec_ext.engine, "SpeculativeDecoder", FakeDecoder)
    assert cli.main(["generate", "--prompt", "x", "--drafter", "ngram", "--device", "cpu", "-k", "3"]) == 0
    made = FakeDecoder.made
    assert made["max_batch_size"] == 1 and made["adaptive"] is True and made["k"] == 3, made
    out = capsys.readouterr()
    assert out.out == "bcd\n"
    assert "[ngram drafter, k <= 3, adaptive: 3 tokens" in out.err and "6.0 tokens/s" in out.err, out.err
    assert "cost-model calibration 0.25 s" in out.err and "finished: length" in out.err, out.err
    assert cli.main(["generate", "--prompt", "x", "--drafter", "ngram", "--device", "cpu", "--no-adaptive",
                     "--max-batch-size", "4"]) == 0
    made = FakeDecoder.made
    assert made["max_batch_size"] == 4 and made["adaptive"] is False and made["sampling"] == "rejection", made
    assert "k <= 4, fixed" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--drafter", "ngram", "--device", "cpu", "--sampling", "block"]) == 0
    assert FakeDecoder.made["sampling"] == "block", FakeDecoder.made
    assert cli.main(["generate", "--prompt", "x", "--drafter", "ngram", "--device", "cpu", "--repetition-penalty",
                     "1.2", "--stop", "zz", "--stop", "\n", "--logit-bias", "7=-3", "--min-p", "0.1"]) == 0
    controls = FakeDecoder.controls
    assert controls["repetition_penalty"] == 1.2 and controls["stop"] == ["zz", "\n"], controls
    assert controls["logit_bias"] == {7: -3.0} and controls["min_p"] == 0.1 and controls["logprobs"] is None, controls


def test_generate_streams_whole_characters(monkeypatch):
    # A Japanese sentence with an emoji, accepted 1 to 3 tokens a round: each printed piece is whole characters.
    import specdec_ext.engine
    import specdec_ext.factory
    from specdec_ext.models import default_model_path, load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    text = "富士山は日本で一番高い山です。🗻"
    ids = tokenizer(text)["input_ids"]
    chunks = []
    while len(sum(chunks, [])) < len(ids):
        done = len(sum(chunks, []))
        chunks.append(ids[done:done + 1 + len(chunks) % 3])
    printed = []
    monkeypatch.setattr(specdec_ext.factory, "load", lambda path, device, **options: (fake_model(), tokenizer))
    monkeypatch.setattr(specdec_ext.engine, "SpeculativeDecoder", FakeDecoder)
    monkeypatch.setattr(FakeDecoder, "chunks", tuple(chunks))
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append((a, k.get("file"))))
    assert cli.main(["generate", "--prompt", "x", "--drafter", "ngram", "--device", "cpu"]) == 0
    pieces = [a[0] for a, file in printed if file is None and a and a[0]]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == text, pieces


@pytest.mark.parametrize("error", [ValueError("prompt 0 holds token ids outside [0, 10)\nsecond line"),
                                   RuntimeError("CUDA out of memory")])
def test_library_errors_are_one_line(error, monkeypatch, capsys):
    import specdec_ext.factory

    def fail(path, device, **options):
        raise error

    monkeypatch.setattr(specdec_ext.factory, "load", fail)
    assert cli.main(["generate", "--prompt", "x", "--device", "cpu"]) == 1
    first, *rest = str(error).splitlines()
    assert capsys.readouterr().err == f"specdec: error: {first}{' ...' if rest else ''}\n"


def test_prompt_longer_than_the_context_is_a_usage_error(monkeypatch, capsys):
    import specdec_ext.factory

    model = fake_model()
    model.config.max_position_embeddings = 3
    monkeypatch.setattr(specdec_ext.factory, "load", lambda path, device, **options: (model, FakeTokenizer()))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "x", "--drafter", "ngram", "--device", "cpu"])
    assert e.value.code == 2
    assert "specdec generate: error: --prompt is 3 tokens; the model's context is 3 tokens" in capsys.readouterr().err


def generate_process(*args):
    return subprocess.Popen([sys.executable, "-m", "specdec_ext.cli", "generate", "--device", "cpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_closed_pipe_ends_quietly():
    # `specdec generate ... | head -c 10`: the reader goes away while tokens are still streamed.
    p = generate_process("--max-new-tokens", "64", "--prompt", "The history of Rome")
    head = p.stdout.read(10)
    p.stdout.close()
    err = p.communicate(timeout=600)[1].decode()
    assert len(head) == 10
    assert p.returncode in (0, 141), err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("hook,marker", [(BLOCK_IN_LOADING, LOADING), (BLOCK_IN_STREAMING, STREAMING)],
                         ids=["while-loading", "while-decoding"])
def test_interrupt_exits_130(hook, marker):
    # Ctrl-C once the child says it is loading the model, or decoding with the real one (its first round streamed):
    # the interrupt lands where the marker says, whatever the machine's speed.
    p = subprocess.Popen(cli_child(hook, "generate", "--device", "cpu", "--max-new-tokens", "512", "--prompt",
                                   "The history of Rome"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    before = read_until(p.stderr, marker.encode(), p)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=600)
    err = (before + err).decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "specdec: interrupted", err

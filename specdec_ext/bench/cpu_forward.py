"""The target's forward on the CPU: GEMM, forward by block width, plain and speculative decoding, memory.

In one process, paired where two things compare.

1. GEMM: skinny_linear (float32, bfloat16) and quantized_linear (the shipped file's Q4_1 and Q8_0, float and 8-bit
   activations) against F.linear (MKL) on the shipped model's projection shapes, 1-16 rows: microseconds, GFLOP/s,
   weight GB/s, and GFLOP/s as a share of the FMA peak (MKL's rate on a large square sgemm, measured here, stands
   for it).
2. One forward of Q = 1, 2, 4, 8, 16 new tokens at a 200-token context (B = 1): float32, bfloat16 and the shipped
   file kept quantised (float and 8-bit activations), alternated per repeat; relative to Q = 1.
3. Plain greedy decoding at B = 1 (128 tokens, the e2e prompts): ours float32, ours kept-Q4_1 (both activations),
   transformers float32 and llama.cpp (`--against llama.cpp`: llama-cpp-python on the same .gguf file and thread
   count), one repeat of each in turn; with the weight-read floor of each of ours.
4. Peak RSS of a process that loads the model: float32, bfloat16, kept-Q4_1.
5. Speculative decoding at B = 1, greedy, adaptive, against our plain decoding of the same model: the shipped EAGLE
   head with trees (the default TreeSettings) on held-out chat prompts, float32 and kept-Q4_1 int8; the demo's
   rewrite prompt on the kept-Q4_1 int8 model with the demo's drafter for it (n-gram prompt lookup, k <= 6) and with
   EAGLE trees, there also against llama.cpp's plain decoding.
"""
import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from specdec_ext import ops
from specdec_ext.models import LlamaForCausalLM, default_model_path, load_tokenizer
from specdec_ext.models.quantized import is_quantized

from .common import add_common_arguments, median_us, print_row, report, save
from .e2e import PROMPTS, heldout_prompts, read_bandwidth_gbs

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16)
CPU = torch.device("cpu")


TABLES = ("gemm", "rss", "forward", "plain", "speculative")


def table_list(text: str) -> list[str]:
    names = text.split(",")
    if not names or any(n not in TABLES for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(TABLES)}")
    return names


def add_arguments(parser) -> None:
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--against", choices=["llama.cpp"], default=None,
                        help="also decode with llama.cpp (llama-cpp-python, built as docs/development.md says) on the "
                             "same .gguf file, prompts and thread count")
    parser.add_argument("--tables", type=table_list, default=list(TABLES),
                        help=f"the tables to run (default all: {','.join(TABLES)})")
    # Its rows have no single speed-up to draw: no --plot.
    add_common_arguments(parser, repeats=20, cpu_only=True, plot=False)


def fma_peak_gflops() -> float:
    """MKL's sgemm rate on 2048^3 (near the cores' FMA peak; the reference for the GEMM's share of it)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    us = median_us(lambda: a @ b, CPU, repeats=5, warmup=2)
    return 2 * 2048 ** 3 / (us * 1e-6) / 1e9


def random_blocks(format: int, n: int, k: int) -> torch.Tensor:
    """Blocks of `format` with finite fp16 scales (the decode cost does not depend on the values)."""
    weights, nbytes = ops.QUANTIZED_FORMATS[format]
    blocks = torch.randint(0, 256, (n, k // weights, nbytes), dtype=torch.uint8)
    blocks[:, :, :2] = torch.full((n, k // weights), 0.01).half().view(torch.uint8).reshape(n, k // weights, 2)
    return blocks.reshape(n, -1)


def gemm_rows(repeats: int, peak: float) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k)
        q4_1, q8_0 = random_blocks(3, n, k), random_blocks(8, n, k)
        weights = {"float32": w32, "bfloat16": w32.bfloat16(), "Q4_1": q4_1, "Q4_1 int8": q4_1, "Q8_0": q8_0,
                   "Q8_0 int8": q8_0}
        for m in ROWS:
            x = torch.randn(m, k)
            mkl = median_us(lambda: F.linear(x, w32), CPU, repeats)
            for kind, w in weights.items():
                if kind.startswith("Q"):
                    fmt = 3 if kind.startswith("Q4_1") else 8
                    act = "int8" if kind.endswith("int8") else "float"
                    us = median_us(lambda: ops.quantized_linear(x, w, fmt, activations=act), CPU, repeats)
                else:
                    xs = x.to(w.dtype)
                    us = median_us(lambda: ops.skinny_linear(xs, w), CPU, repeats)
                gflops = 2 * m * n * k / (us * 1e-6) / 1e9
                rows.append({"shape": f"{name} {n}x{k}", "weights": kind, "M": m, "ours_us": us, "mkl_f32_us": mkl,
                             "vs_mkl": mkl / us, "gflops": gflops, "of_peak": gflops / peak,
                             "weight_gbs": w.numel() * w.element_size() / (us * 1e-6) / 1e9})
    return rows


def load_kinds():
    path = default_model_path()
    return {"float32": LlamaForCausalLM.from_pretrained(path),
            "bfloat16": LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
            "kept-Q4_1": LlamaForCausalLM.from_pretrained(path, keep_quantized=True, activations="float"),
            "kept-Q4_1 int8": LlamaForCausalLM.from_pretrained(path, keep_quantized=True, activations="int8")}


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights (the tied head once)."""
    seen, total = set(), 0
    for obj in [model.embed_tokens, model.lm_head, model.norm] + [getattr(layer, name) for layer in model.layers
                                                                  for name in ("input_layernorm", "qkv_proj", "o_proj",
                                                                               "post_attention_layernorm",
                                                                               "gate_up_proj", "down_proj")]:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += obj.nbytes if is_quantized(obj) else obj.numel() * obj.element_size()
    return total


def forward_rows(models: dict, repeats: int) -> list[dict]:
    caches = {}
    with torch.no_grad():
        for kind, m in models.items():
            caches[kind] = m.new_kv_cache(1, 512)
            m(torch.randint(0, 1000, (1, 200)), caches[kind], logits_indices=torch.tensor([199]))
            caches[kind].advance(200)
        rows, base = [], {}
        for q in (1, 2, 4, 8, 16):
            ids = torch.randint(0, 1000, (1, q))
            times = {kind: [] for kind in models}
            for kind, m in models.items():
                m(ids, caches[kind])  # warm-up
            for _ in range(repeats):
                for kind, m in models.items():
                    t0 = time.perf_counter()
                    m(ids, caches[kind])
                    times[kind].append(time.perf_counter() - t0)
            for kind, ts in times.items():
                ms = statistics.median(ts) * 1e3
                base.setdefault(kind, ms)
                rows.append({"weights": kind, "Q": q, "forward_ms": ms, "vs_Q1": ms / base[kind]})
    return rows


class LlamaCpp:
    """llama.cpp (llama-cpp-python) greedy decoding of token ids, exactly n new tokens (EOS not special)."""

    def __init__(self, path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)

    def generate(self, ids: list[int], n: int) -> list[int]:
        self.llm.reset()
        out = []
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return out


def llama_cpp(path):
    try:
        cpp = LlamaCpp(path, torch.get_num_threads())
    except ImportError:
        print("--against llama.cpp: llama-cpp-python is not installed (docs/development.md says how to build it): no "
              "llama.cpp rows", flush=True)
        return None
    import llama_cpp as package

    print(f"--against llama.cpp: llama-cpp-python {package.__version__}", flush=True)
    return cpp


def alternate(runs: dict, repeats: int) -> dict:
    """Each run (returns its token lists) once in turn per repeat, after one warm-up each: median tokens/s, tokens."""
    for run in runs.values():
        run()
    rates, tokens = {k: [] for k in runs}, {}
    for _ in range(repeats):
        for kind, run in runs.items():
            t0 = time.perf_counter()
            tokens[kind] = run()
            rates[kind].append(sum(len(t) for t in tokens[kind]) / (time.perf_counter() - t0))
    return {kind: (statistics.median(r), tokens[kind]) for kind, r in rates.items()}


def plain_rows(models, tokenizer, cpp, new_tokens, repeats, bandwidth) -> list[dict]:
    import transformers

    from specdec_ext.engine import generate_autoregressive
    from specdec_ext.factory import prompt_ids

    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    rows = []
    for name, text in PROMPTS.items():
        ids = prompt_ids(tokenizer, text)
        runs = {kind: (lambda m=models[kind]: generate_autoregressive(m, [ids], new_tokens).sequences)
                for kind in ("float32", "kept-Q4_1", "kept-Q4_1 int8")}

        def hf_run():
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=tokenizer.eos_token_id)
            return [out[0, len(ids):].tolist()]

        runs["transformers float32"] = hf_run
        if cpp is not None:
            runs["llama.cpp Q4_1"] = lambda: [cpp.generate(ids, new_tokens)]
        result = alternate(runs, repeats)
        reference = result["float32"][1][0]
        for kind, (tps, tokens) in result.items():
            row = {"prompt": name, "decoder": kind, "tok_s": tps,
                   "vs_transformers": tps / result["transformers float32"][0],
                   "vs_llama_cpp": tps / result["llama.cpp Q4_1"][0] if cpp is not None else float("nan"),
                   "same_tokens_as_ours_f32": tokens[0] == reference, "of_floor": float("nan")}
            if kind in models:
                row["of_floor"] = tps / (bandwidth * 1e9 / weight_bytes(models[kind]))
            rows.append(row)
            print_row(row)
    return rows


def rss_rows() -> list[dict]:
    """Resident memory of a fresh process before and after loading (VmRSS: the import of torch is most of the
    first), and its peak (VmHWM)."""
    rows = []
    for kind, args in (("float32", ""), ("bfloat16", ", dtype=torch.bfloat16"), ("kept-Q4_1", ", keep_quantized=True")):
        code = ("import re, torch\nfrom specdec_ext.models import LlamaForCausalLM, default_model_path\n"
                "status = lambda: open('/proc/self/status').read()\n"
                "mb = lambda key: int(re.search(key + r':\\s+(\\d+)', status()).group(1)) / 1024\n"
                "before = mb('VmRSS')\n"
                f"m = LlamaForCausalLM.from_pretrained(default_model_path(){args})\n"
                "print(before, mb('VmRSS'), mb('VmHWM'))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        before, after, peak = (float(v) for v in out[-3:])
        rows.append({"weights": kind, "model_rss_mb": after - before, "peak_rss_mb": peak, "rss_before_mb": before})
    return rows


def speculative_rows(models, tokenizer, cpp, new_tokens, repeats) -> list[dict]:
    from specdec_ext.demo import QUESTIONS
    from specdec_ext.engine import SpeculativeDecoder
    from specdec_ext.factory import make_drafter, prompt_ids
    from specdec_ext.trees import TreeSettings

    path = default_model_path()
    rewrite = [prompt_ids(tokenizer, QUESTIONS["ngram"], chat=True)]
    # (weights, prompts, drafter, its settings): the EAGLE head's trees on held-out chat; the demo's rewrite task
    # with the demo's drafter for it (n-gram prompt lookup, k <= 6) and with EAGLE trees.
    chat = heldout_prompts(tokenizer)
    cases = [("float32", "held-out chat", chat, "eagle", dict(tree=TreeSettings())),
             ("kept-Q4_1 int8", "held-out chat", chat, "eagle", dict(tree=TreeSettings())),
             ("kept-Q4_1 int8", "demo rewrite", rewrite, "ngram", dict(num_speculative_tokens=6)),
             ("kept-Q4_1 int8", "demo rewrite", rewrite, "eagle", dict(tree=TreeSettings()))]
    rows = []
    for kind, label, prompts, drafter, settings in cases:
        model = models[kind]
        dec = SpeculativeDecoder(model, make_drafter(drafter, model, path), max_batch_size=1,
                                 **{"num_speculative_tokens": 8, **settings})
        shape = "tree" if "tree" in settings else "chain"
        for ids in prompts:
            runs = {"speculative": lambda: dec.generate([ids], new_tokens).sequences,
                    "plain": lambda: dec.generate_autoregressive([ids], new_tokens).sequences}
            if cpp is not None and kind.startswith("kept-Q4_1"):
                runs["llama.cpp Q4_1 plain"] = lambda: [cpp.generate(ids, new_tokens)]
            result = alternate(runs, repeats)
            spec_tps, spec_tokens = result["speculative"]
            row = {"weights": kind, "prompt": label, "drafter": f"{drafter} {shape}", "spec_tok_s": spec_tps,
                   "plain_tok_s": result["plain"][0],
                   "vs_plain": spec_tps / result["plain"][0], "same_as_plain": spec_tokens == result["plain"][1],
                   "vs_llama_cpp": spec_tps / result["llama.cpp Q4_1 plain"][0] if len(result) == 3 else float("nan")}
            rows.append(row)
            print_row(row)
    return rows


def main(args) -> int:
    repeats, new_tokens, tables = args.repeats, args.new_tokens, args.tables
    peak, bandwidth = fma_peak_gflops(), read_bandwidth_gbs()
    print(f"{ops.cpu_isa()} kernels, {torch.get_num_threads()} threads; FMA peak (MKL sgemm 2048^3) {peak:.0f} "
          f"GFLOP/s, read bandwidth {bandwidth:.1f} GB/s", flush=True)
    meta = {"title": "the target's forward on the CPU", "isa": ops.cpu_isa(), "threads": torch.get_num_threads(),
            "fma_peak_gflops": peak, "read_bw_gbs": bandwidth}
    rows = []
    if "gemm" in tables:
        gemm = gemm_rows(max(5, repeats), peak)
        report("GEMM: ours against F.linear (MKL, float32 weights)", gemm,
               ["shape", "weights", "M", "ours_us", "mkl_f32_us", "vs_mkl", "gflops", "of_peak", "weight_gbs"])
        rows += [{"table": "gemm", **r} for r in gemm]
    if "rss" in tables:
        rss = rss_rows()
        report("memory of a process loading the shipped model (MB)", rss, ["weights", "model_rss_mb", "peak_rss_mb",
                                                                             "rss_before_mb"])
        rows += [{"table": "rss", **r} for r in rss]
    if not {"forward", "plain", "speculative"} & set(tables):
        save(args, meta, rows, ["table", "weights"])
        return 0
    models = load_kinds()
    if "forward" in tables:
        forward = forward_rows(models, max(5, repeats // 2))
        report("one forward of Q new tokens at a 200-token context, B = 1", forward,
               ["weights", "Q", "forward_ms", "vs_Q1"])
        rows += [{"table": "forward", **r} for r in forward]
    tokenizer = load_tokenizer(default_model_path())
    cpp = llama_cpp(default_model_path()) if args.against == "llama.cpp" else None
    runs = max(3, repeats // 6)
    if "plain" in tables:
        plain = plain_rows(models, tokenizer, cpp, new_tokens, runs, bandwidth)
        report(f"plain greedy decoding, B = 1, {new_tokens} tokens", plain,
               ["prompt", "decoder", "tok_s", "vs_transformers", "vs_llama_cpp", "of_floor", "same_tokens_as_ours_f32"])
        rows += [{"table": "plain", **r} for r in plain]
    if "speculative" in tables:
        spec = speculative_rows(models, tokenizer, cpp, new_tokens, runs)
        report("speculative decoding, B = 1, greedy, adaptive", spec,
               ["weights", "prompt", "drafter", "spec_tok_s", "plain_tok_s", "vs_plain", "vs_llama_cpp",
                "same_as_plain"])
        rows += [{"table": "speculative", **r} for r in spec]
    save(args, meta, rows, ["table", "weights"])
    return 0

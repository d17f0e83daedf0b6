"""`specdec bench e2e`: plain greedy decoding of the shipped model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantised)
by this library's forward against transformers' `generate` on the same weights, dtype and thread count, in
the same process: tokens/s (median of repeats after a warm-up run), the ratio, peak RSS, and each row against
the weight-read floor (weight bytes per decode step over the read bandwidth measured here). Then the cost of
one forward of Q = 1, 2, 3, 5, 9 new tokens relative to Q = 1: what a verify step of speculative decoding costs.
"""
import resource
import statistics
import time

import torch

from specdec_ext.decoding import generate_autoregressive
from specdec_ext.models import LlamaForCausalLM, default_model_path, load_tokenizer

from .common import median_us, report, save

PARAGRAPH = (
    "The Rhine is a river that begins in the Swiss canton of Graubunden in the southeastern Swiss Alps. It forms "
    "part of the Swiss-Liechtenstein, Swiss-Austrian and Swiss-German borders, then the Franco-German border, "
    "then flows through the German Rhineland and the Netherlands and eventually empties into the North Sea. "
    "The river is one of the most important waterways of Europe, carrying goods from the port of Rotterdam "
    "deep into the continent.")
PROMPTS = {
    "chat": "What are three good habits for staying healthy? Answer briefly.",
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "summarise": f"Summarise this paragraph in two sentences, reusing its wording:\n\n{PARAGRAPH}",
}


def read_bandwidth_gbs(nbytes: int = 512 << 20) -> float:
    """Bytes read per second by a sum over a tensor much larger than the caches."""
    x = torch.ones(nbytes // 4)
    us = median_us(lambda: x.sum(), torch.device("cpu"), repeats=10, warmup=2)
    return nbytes / (us * 1e-6) / 1e9


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tokens_per_second(run, repeats: int) -> tuple[float, list]:
    """Median tokens/s over `repeats` timed runs after one warm-up run; run() returns the generated sequences."""
    run()
    rates, sequences = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        sequences = run()
        rates.append(sum(len(s) for s in sequences) / (time.perf_counter() - t0))
    return statistics.median(rates), sequences


def transformers_generate(hf_model, tokenizer, prompts, new_tokens):
    """Greedy generate of a left-padded batch; returns each request's new tokens up to and including EOS."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, pad_token_id=pad)[:, width:]
    return [row.tolist() for row in out]


def forward_costs(model, repeats: int) -> list[dict]:
    """Median time of one forward of Q new tokens at a 200-token context, relative to Q = 1."""
    cache = model.new_kv_cache(1, 512)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 200)), cache, logits_indices=torch.tensor([199]))
        cache.advance(200)
        rows = []
        for q in (1, 2, 3, 5, 9):
            ids = torch.randint(0, model.config.vocab_size, (1, q))
            rows.append({"Q": q, "forward_ms": median_us(lambda: model(ids, cache), torch.device("cpu"), repeats) / 1e3})
    for r in rows:
        r["vs_Q1"] = r["forward_ms"] / rows[0]["forward_ms"]
    return rows


def main(args) -> int:
    import transformers

    path = default_model_path()
    tokenizer = load_tokenizer(path)
    batches = [int(x) for x in args.batch.split(",")] if args.batch else [1, 4]
    dtypes = [getattr(torch, d) for d in (args.dtype or "float32,bfloat16").split(",")]
    new_tokens = args.new_tokens or 128
    repeats = max(1, args.repeats if args.repeats != 50 else 3)
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            for p in PROMPTS.values()]
    chat = [c["input_ids"] if hasattr(c, "keys") else list(c) for c in chat]
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s, {torch.get_num_threads()} threads, {new_tokens} new tokens", flush=True)
    rows, costs = [], []
    for dtype in dtypes:
        ours = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=dtype).eval()
        weight_bytes = sum(t.numel() * t.element_size() for t in ours.parameters())  # the tied head counted once
        floor = bandwidth * 1e9 / weight_bytes  # decode steps per second if only the weights were read
        for batch in batches:
            for i, name in enumerate(PROMPTS):
                prompts = [chat[(i + j) % len(chat)] for j in range(batch)]  # B > 1: the other prompts after it
                ours_tps, ours_seq = tokens_per_second(
                    lambda: generate_autoregressive(ours, prompts, new_tokens).sequences, repeats)
                ours_rss = peak_rss_mb()
                with torch.no_grad():
                    hf_tps, hf_seq = tokens_per_second(lambda: transformers_generate(hf, tokenizer, prompts, new_tokens),
                                                       repeats)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "B": batch, "prompt": name,
                             "ours_tok_s": ours_tps, "transformers_tok_s": hf_tps, "speedup": ours_tps / hf_tps,
                             "floor_tok_s": floor * batch, "of_floor": ours_tps / (floor * batch),
                             "same_tokens": ours_seq[0] == hf_seq[0], "peak_rss_mb": ours_rss})
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                      flush=True)
        costs += [{"dtype": str(dtype).removeprefix("torch."), **r} for r in forward_costs(ours, max(5, repeats * 3))]
        del ours, hf
    report(f"plain greedy decoding, SmolLM2-135M-Instruct, CPU, {torch.get_num_threads()} threads, {new_tokens} new "
           f"tokens (read bandwidth {bandwidth:.1f} GB/s)", rows,
           ["dtype", "B", "prompt", "ours_tok_s", "transformers_tok_s", "speedup", "floor_tok_s", "of_floor",
            "same_tokens", "peak_rss_mb"])
    report("one forward of Q new tokens (context 200, B = 1), relative to Q = 1", costs,
           ["dtype", "Q", "forward_ms", "vs_Q1"])
    save(args, {"title": "plain decoding, ours vs transformers", "read_bw_gbs": bandwidth, "forward_costs": costs},
         rows, ["dtype", "B", "prompt"])
    return 0

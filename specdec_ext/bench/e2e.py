"""The shipped model decoding end to end: plain against transformers, speculative against plain (CPU).

The shipped model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantised) end to end, in one process on the same weights,
dtype and thread count, tokens/s as the median of repeats after a warm-up run.

1. Plain greedy decoding by this library's forward against transformers' `generate`: the ratio, peak RSS, and
   each row against the weight-read floor (weight bytes per decode step over the read bandwidth measured
   here); then the cost of one forward of Q = 1, 2, 3, 5, 9 new tokens relative to Q = 1.
2. Speculative decoding (SpeculativeDecoder; the n-gram drafter, the shipped EAGLE head and Medusa heads, and
   with --draft a model drafter, and Lookahead with --drafters lookahead[:W/N/G]; fixed k and adaptive) on three
   fixed prompts and on held-out chat prompts of the shipped prompt set (a run decodes them all, B at a time),
   greedy and sampled (temperature 0.7, top-p 0.9), against our plain decoding of the same requests and against
   transformers' plain and prompt-lookup generate (prompt_lookup_num_tokens=10, batch 1 only): speedups, acceptance
   rate (in total and per position), mean acceptance length and the time split. Tree rows (--tree, repeatable; by
   default the default TreeSettings): the same drafters (eagle, medusa, ngram) proposing trees, at the fixed node
   budget and, with "adaptive" in --k, with the adaptive one; k reads "tree N/D/B" (nodes, depth, branching),
   drafted = drafts per round.
3. With --target synthetic:NAME (on --device cpu or cuda): a synthetic target's rows with OracleDrafter at set
   acceptances: speedup, tokens per round against the chain formula, the Leviathan bound and the round's efficiency
   (e2e_synthetic.py).
"""
import math
import os
import resource
import statistics
import time

import torch

from specdec_ext.drafters import registry
from specdec_ext.engine import SpeculativeDecoder, generate_autoregressive
from specdec_ext.factory import make_drafter, prompt_ids
from specdec_ext.models import LlamaForCausalLM, default_model_path, load_tokenizer
from specdec_ext.trees import TreeSettings

from .common import add_common_arguments, int_list, median_us, print_row, report, save
from .e2e_synthetic import StepCosts, leviathan_bound

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
# "heldout": the first HELDOUT_COUNT held-out prompts of the shipped prompt set in these categories (ordinary chat;
# the draft heads never saw them).
HELDOUT_CATEGORIES = ("chat", "explain", "list", "writing")
HELDOUT_COUNT = 4


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[1, 4], help="batch sizes B (default 1,4)")
    parser.add_argument("--k", default=None, help="comma-separated draft lengths: fixed k and 'adaptive' (default "
                        "2,4,8,adaptive; lookahead: its own settings, fixed when a number is given)")
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="comma-separated dtypes (default float32,bfloat16; the speculative table: the first)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--prompts", default=None, help="comma-separated prompt names (chat,code,summarise, and "
                        "heldout: held-out chat prompts of the shipped prompt set, never trained on)")
    parser.add_argument("--drafters", default=None, help="comma-separated drafters, each "
                        f"{registry.spelled([e.syntax for e in registry.drafters()])} (default ngram,eagle,medusa: "
                        "prompt lookup and the shipped model's trained heads)")
    parser.add_argument("--sampling", default=None,
                        help="greedy,sampled,block,invariant (sampled: temperature 0.7, top-p 0.9, rejection "
                             "sampling; block: the same with block verification, chain rows only; invariant: the "
                             "same with Gumbel coupling; default greedy,sampled)")
    parser.add_argument("--heldout-count", type=int, default=HELDOUT_COUNT,
                        help=f"held-out prompts in the heldout row (default {HELDOUT_COUNT}; the set has 15)")
    parser.add_argument("--heldout-samples", type=int, default=1,
                        help="requests per held-out prompt, each with its own seed (default 1)")
    parser.add_argument("--draft", default=None, help="a draft model (HF dir or .gguf) for ModelDrafter rows; with "
                        "--target synthetic:NAME, comma-separated synthetic:NAME, head (one layer at the target's "
                        "width) or none (default none)")
    parser.add_argument("--target", default=None, help="synthetic:NAME (tiny, llama-3.2-1b, llama-3.1-8b: random "
                        "weights at those shapes, made on the device) for the oracle's rows (bound and efficiency); "
                        "default: the shipped model's rows")
    parser.add_argument("--oracle-acceptance", default="0.8",
                        help="with --target synthetic: comma-separated acceptances a of OracleDrafter (default 0.8)")
    parser.add_argument("--cuda-graphs", default="on", choices=["on", "off"],
                        help="with --target synthetic on CUDA: the decoder's CUDA graphs (default on)")
    parser.add_argument("--tree", action="append", default=None, help="tree rows of these settings, N or "
                        "nodes=N,depth=D,branching=K (repeatable; default: the default TreeSettings; none: no tree "
                        "rows)")
    parser.add_argument("--plain-only", action="store_true", help="only plain decoding against transformers")
    parser.add_argument("--speculative-only", action="store_true", help="only the speculative table")
    add_common_arguments(parser, repeats=3)
    parser.set_defaults(validate=check_arguments)


def check_arguments(args) -> None:
    """--draft (a path for the shipped model's rows), --target and, with a synthetic target, --draft's names,
    --oracle-acceptance, --k and --sampling: ValueError before anything loads."""
    if args.target is None:
        if args.draft is not None and not os.path.exists(args.draft):
            raise ValueError(f"--draft {args.draft}: no such file or directory")
        return
    from specdec_ext.models import SYNTHETIC_PRESETS

    name = args.target.partition(":")[2]
    if not args.target.startswith("synthetic:") or name not in SYNTHETIC_PRESETS:
        raise ValueError(f"--target must be synthetic:NAME with NAME one of {', '.join(SYNTHETIC_PRESETS)}, got "
                         f"{args.target!r}")
    for spec in (args.draft or "none").split(","):
        kind, _, preset = spec.partition(":")
        if spec not in ("none", "head") and not (kind == "synthetic" and preset in SYNTHETIC_PRESETS):
            raise ValueError(f"--draft with a synthetic target: synthetic:NAME, head or none, got {spec!r}")
    try:
        acceptances = [float(a) for a in args.oracle_acceptance.split(",")]
        ks = [int(k) for k in (args.k or "4").split(",")]
    except ValueError:
        raise ValueError("--oracle-acceptance takes numbers in [0, 1] and --k draft lengths (integers) with a "
                         "synthetic target") from None
    modes = (args.sampling or "greedy").split(",")
    if not set(modes) <= {"greedy", "invariant"}:
        raise ValueError(f"--sampling with a synthetic target: greedy or invariant (the oracle's acceptance holds "
                         f"where the target emits the reference's tokens), got {args.sampling!r}")
    if not all(0 <= a <= 1 for a in acceptances) or min(ks) < 1:
        raise ValueError(f"--oracle-acceptance must be in [0, 1] and --k >= 1, got {acceptances}, {ks}")


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


SAMPLING = {"greedy": {}, "sampled": {"temperature": 0.7, "top_p": 0.9},
            "block": {"temperature": 0.7, "top_p": 0.9}, "invariant": {"temperature": 0.7, "top_p": 0.9}}
# The decoders' sampling= per mode: "sampled" verifies by rejection sampling draft by draft, "block" by block
# verification (chain rows only), "invariant" by Gumbel coupling (whose output must equal plain decoding's:
# same_as_plain is checked as for greedy).
DECODER_SAMPLING = {"greedy": "rejection", "sampled": "rejection", "block": "block", "invariant": "invariant"}


def paired_tokens_per_second(run_a, run_b, repeats: int) -> tuple:
    """run_a and run_b alternated `repeats` times after one warm-up each, so that a drift in the machine's speed
    hits both: (median tokens/s of a, of b, median of the per-repeat ratios b / a, a's and b's sequences)."""
    run_a(), run_b()
    rates_a, rates_b = [], []
    for _ in range(repeats):
        for run, rates in ((run_a, rates_a), (run_b, rates_b)):
            t0 = time.perf_counter()
            sequences = run()
            rates.append(sum(len(s) for s in sequences) / (time.perf_counter() - t0))
            if run is run_a:
                seq_a = sequences
            else:
                seq_b = sequences
    ratio = statistics.median(b / a for a, b in zip(rates_a, rates_b))
    return statistics.median(rates_a), statistics.median(rates_b), ratio, seq_a, seq_b


def transformers_generate(hf_model, tokenizer, prompts, new_tokens, sampling=None, **extra):
    """generate() of a left-padded batch, greedy or with `sampling` (temperature, top_p), exactly new_tokens new
    tokens each; extra: e.g. prompt_lookup_num_tokens (batch 1)."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sample = dict(do_sample=True, top_k=0, **sampling) if sampling else dict(do_sample=False)
    out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            pad_token_id=pad, **sample, **extra)[:, width:]
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
            forward_us = median_us(lambda: model(ids, cache), torch.device("cpu"), repeats)
            rows.append({"Q": q, "forward_ms": forward_us / 1e3})
    for r in rows:
        r["vs_Q1"] = r["forward_ms"] / rows[0]["forward_ms"]
    return rows


def chat_prompts(tokenizer) -> list:
    return [prompt_ids(tokenizer, p) for p in PROMPTS.values()]


def batch_of(chat, i, batch):
    """Prompt i, and for B > 1 the other prompts after it."""
    return [chat[(i + j) % len(chat)] for j in range(batch)]


def heldout_prompts(tokenizer, count: int = HELDOUT_COUNT) -> list:
    from specdec_ext.training import load_prompts

    rows = [r for r in load_prompts("heldout") if r["category"] in HELDOUT_CATEGORIES][:count]
    return [prompt_ids(tokenizer, r["prompt"]) for r in rows]


def plain_rows(args, path, tokenizer, chat, batches, dtypes, new_tokens, repeats, bandwidth):
    import transformers

    rows, costs = [], []
    for dtype in dtypes:
        ours = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=dtype).eval()
        weight_bytes = sum(t.numel() * t.element_size() for t in ours.parameters())  # the tied head counted once
        floor = bandwidth * 1e9 / weight_bytes  # decode steps per second if only the weights were read
        for batch in batches:
            for i, name in enumerate(PROMPTS):
                prompts = batch_of(chat, i, batch)
                ours_tps, ours_seq = tokens_per_second(
                    lambda: generate_autoregressive(ours, prompts, new_tokens).sequences, repeats)
                ours_rss = peak_rss_mb()
                with torch.no_grad():
                    hf_tps, hf_seq = tokens_per_second(
                        lambda: transformers_generate(hf, tokenizer, prompts, new_tokens), repeats)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "B": batch, "prompt": name,
                             "ours_tok_s": ours_tps, "transformers_tok_s": hf_tps, "speedup": ours_tps / hf_tps,
                             "floor_tok_s": floor * batch, "of_floor": ours_tps / (floor * batch),
                             "same_tokens": ours_seq[0] == hf_seq[0], "peak_rss_mb": ours_rss})
                print_row(rows[-1])
        costs += [{"dtype": str(dtype).removeprefix("torch."), **r} for r in forward_costs(ours, max(5, repeats * 3))]
        ours = hf = None  # free both before the next dtype's load
    report(f"plain greedy decoding, SmolLM2-135M-Instruct, CPU, {torch.get_num_threads()} threads, {new_tokens} new "
           f"tokens (read bandwidth {bandwidth:.1f} GB/s)", rows,
           ["dtype", "B", "prompt", "ours_tok_s", "transformers_tok_s", "speedup", "floor_tok_s", "of_floor",
            "same_tokens", "peak_rss_mb"])
    report("one forward of Q new tokens (context 200, B = 1), relative to Q = 1", costs,
           ["dtype", "Q", "forward_ms", "vs_Q1"])
    return rows, costs


def own_configs(drafter, ks) -> list:
    """The rows of a drafter whose rounds are trees of its own (Lookahead): its settings fixed (when ks has a number)
    and adaptive (when ks has "adaptive"); none for the others."""
    if drafter.round_tree() is None:
        return []
    label = f"W{drafter.window} N{drafter.ngram} G{drafter.guesses}"
    return ([(label, 8, False, None)] if any(k != "adaptive" for k in ks) else []) + \
        ([(label + " adaptive", 8, True, None)] if "adaptive" in ks else [])


def speculative_rows(args, path, tokenizer, chat, batches, dtype, new_tokens, repeats):
    """Per prompt, sampling mode and B: transformers' plain (and, at B = 1, prompt-lookup) generate, then every
    drafter and k, each alternated with our plain decoding of the same requests (the speedup is the median of
    the paired ratios). Sampled runs use seeds 0..B-1 (transformers its global RNG)."""
    import transformers

    target = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    # ngram, eagle and medusa (the shipped heads), and with --draft a draft model.
    specs = (args.drafters or "ngram,eagle,medusa").split(",") + ([f"model:{args.draft}"] if args.draft else [])
    drafters = {spec if spec.startswith("lookahead") else spec.partition(":")[0]: make_drafter(spec, target, path)
                for spec in specs}
    heldout = heldout_prompts(tokenizer, args.heldout_count) * args.heldout_samples  # each its own seed
    ks = (args.k or "2,4,8,adaptive").split(",")
    trees = [TreeSettings.of(t) for t in (args.tree or [TreeSettings()]) if t != "none"]
    # (label, num_speculative_tokens, adaptive, tree) per row of a drafter: chains, then trees.
    configs = [(k, 8 if k == "adaptive" else int(k), k == "adaptive", None) for k in ks]
    for t in trees:
        label = f"tree {t.num_nodes}/{t.depth}/{t.branching}"
        configs += [(label, 8, False, t)] + ([(label + " adaptive", 8, True, t)] if "adaptive" in ks else [])
    names = (args.prompts or ",".join(PROMPTS) + ",heldout").split(",")
    modes = (args.sampling or "greedy,sampled").split(",")
    rows = []
    for batch in batches:
        for name in names:
            # heldout: every held-out prompt, B at a time (continuous batching; transformers: chunks of B).
            prompts = heldout if name == "heldout" else batch_of(chat, list(PROMPTS).index(name), batch)
            chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
            for mode in modes:
                sampling = SAMPLING[mode]
                seeds = list(range(len(prompts)))
                plain = SpeculativeDecoder(target, None, max_batch_size=batch, sampling=DECODER_SAMPLING[mode])
                costs = ShippedRoundCosts(target, batch, max(len(p) for p in prompts) + new_tokens // 2,
                                          max(20, repeats * 10))
                def run_plain():
                    return plain.generate_autoregressive(prompts, new_tokens, seed=seeds, **sampling).sequences
                with torch.no_grad():
                    hf_tps, _ = tokens_per_second(lambda: [s for c in chunks for s in transformers_generate(
                        hf, tokenizer, c, new_tokens, sampling)], repeats)
                    lookup_tps = tokens_per_second(lambda: [s for c in chunks for s in transformers_generate(
                        hf, tokenizer, c, new_tokens, sampling, prompt_lookup_num_tokens=10)], repeats)[0] \
                        if batch == 1 else float("nan")
                for drafter_name, drafter in drafters.items():
                    for k, k_max, adaptive, tree in own_configs(drafter, ks) or configs:
                        if tree is not None and (not drafter.supports_trees or mode == "block"):
                            continue
                        dec = SpeculativeDecoder(target, drafter, k_max, adaptive=adaptive, max_batch_size=batch,
                                                 tree=tree, sampling=DECODER_SAMPLING[mode])
                        last = {}

                        def run():
                            last["out"] = dec.generate(prompts, new_tokens, seed=seeds, **sampling)
                            return last["out"].sequences

                        plain_tps, tps, speedup, plain_seq, seq = paired_tokens_per_second(run_plain, run, repeats)
                        st = last["out"].stats
                        spent = max(st.elapsed_s, 1e-9)
                        drafted = st.num_draft_tokens / max(st.num_drafts, 1)
                        # chains: the Leviathan bound at the realised tokens per round and drafts per round
                        c, v = (costs.draft(drafter_name, drafter), costs.verify(round(drafted) + 1)) \
                            if tree is None and st.num_drafts else (math.nan, math.nan)
                        bound = leviathan_bound(st.mean_acceptance_length, drafted, c, v)
                        rows.append({"B": batch, "prompt": name, "sampling": mode, "drafter": drafter_name, "k": k,
                                     "tok_s": tps, "plain_tok_s": plain_tps, "speedup": speedup,
                                     "vs_hf_plain": tps / hf_tps, "vs_hf_lookup": tps / lookup_tps,
                                     "acceptance": st.acceptance_rate, "mean_acc_len": st.mean_acceptance_length,
                                     "drafted": drafted, "c": c, "v": v, "bound": bound,
                                     "efficiency": speedup / bound,
                                     "acc_per_pos": "/".join(f"{a:.2f}" for a in st.acceptance_rate_per_position[:8]),
                                     "draft": st.draft_s / spent, "verify": st.verify_s / spent,
                                     "sample": st.sample_s / spent, "other": st.other_s / spent,
                                     "same_as_plain": seq == plain_seq if mode in ("greedy", "invariant") else "-"})
                        print_row(rows[-1])
    report(f"speculative decoding, SmolLM2-135M-Instruct, {str(dtype).removeprefix('torch.')}, CPU, "
           f"{torch.get_num_threads()} threads, {new_tokens} new tokens; speedup = against our plain decoding, "
           f"vs_hf_* = against transformers' plain / prompt-lookup generate; draft..other: shares of the time", rows,
           ["B", "prompt", "sampling", "drafter", "k", "tok_s", "plain_tok_s", "speedup", "vs_hf_plain", "vs_hf_lookup",
            "acceptance", "mean_acc_len", "drafted", "c", "v", "bound", "efficiency", "acc_per_pos", "draft", "verify",
            "sample", "other", "same_as_plain"])
    return rows


class ShippedRoundCosts:
    """c and v of the shipped model's rows at batch B: a drafter's step (its cost_probe over B rows; none: free) and
    the verify forward of `width` tokens, each timed alternately with the plain decode step (StepCosts), isolated at
    context `context`."""

    def __init__(self, target, batch: int, context: int, repeats: int):
        self.steps = StepCosts(target, batch, context, repeats)
        self.target, self.batch = target, batch
        self.widths, self.drafters = {}, {}

    def verify(self, width: int) -> float:
        if width not in self.widths:
            plain_ms, ms = self.steps.forward(self.target, width)
            self.widths[width] = ms / plain_ms
        return self.widths[width]

    def draft(self, name: str, drafter) -> float:
        if name not in self.drafters:
            probe = drafter.cost_probe()
            if probe is None:
                self.drafters[name] = 0.0
            else:
                plain_ms, ms = self.steps.relative(probe[1](self.batch))
                self.drafters[name] = ms / plain_ms
        return self.drafters[name]


def main(args) -> int:
    if args.target is not None:
        return synthetic_main(args)
    if args.device not in (None, "cpu"):
        raise SystemExit("specdec bench e2e: the shipped model's rows run on the CPU (--target synthetic:NAME runs on "
                         "--device cuda)")
    path = default_model_path()
    tokenizer = load_tokenizer(path)
    batches = args.batch
    dtypes = [getattr(torch, d) for d in args.dtype.split(",")]
    new_tokens, repeats = args.new_tokens, args.repeats
    chat = chat_prompts(tokenizer)
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s, {torch.get_num_threads()} threads, {new_tokens} new tokens",
          flush=True)
    meta = {"title": "decoding end to end", "read_bw_gbs": bandwidth}
    rows = []
    if not args.speculative_only:
        plain, meta["forward_costs"] = plain_rows(args, path, tokenizer, chat, batches, dtypes, new_tokens, repeats,
                                                  bandwidth)
        rows += [{"table": "plain", **r} for r in plain]
    if not args.plain_only:
        rows += [{"table": "speculative", **r} for r in speculative_rows(args, path, tokenizer, chat, batches,
                                                                         dtypes[0], new_tokens, repeats)]
    save(args, meta, rows, ["table", "B", "prompt"] + (["sampling", "drafter", "k"] if not args.plain_only else []))
    return 0


def synthetic_main(args) -> int:
    from .e2e_synthetic import plot, synthetic_rows

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    meta, rows = synthetic_rows(args, device)
    plot_path, args.plot = args.plot, None  # its own plot: speedup against a, with the bound
    save(args, meta, rows, [])
    if plot_path and rows:
        plot(rows, plot_path, meta)
    return 0

"""Continual draft training on one domain the shipped heads never saw: a long run of code-review prompts, each head
(--heads: the shipped EAGLE head, the shipped Medusa heads) frozen against the same head training online
(OnlineDraftTraining), on the float32 shipped model.

--prompts code-review prompts (short Python functions, generated from templates with a fixed seed), decoded one after
another (B = 1, greedy, chains of k = 4, --new-tokens each): the mean acceptance length of the last 20 prompts,
frozen and online, their ratio, and the share of the online run's time its updates took. Greedy output is the
target's either way (checked).
"""
import random
import time

import torch

from .common import add_common_arguments, print_row, report, save

NAMES = ("total", "average", "count_words", "merge", "find_max", "dedupe", "parse_line", "scale", "clip", "flatten")
BODIES = (
    "    result = 0\n    for i in range(1, len({arg})):\n        result += {arg}[i]\n    return result",
    "    if len({arg}) == 0:\n        return None\n    return sum({arg}) / len({arg}) + 1",
    "    seen = []\n    for item in {arg}:\n        if item in seen:\n            seen.append(item)\n    return seen",
    "    best = {arg}[0]\n    for value in {arg}:\n        if value < best:\n            best = value\n    return best",
    "    out = {{}}\n    for key in {arg}:\n        out[key] = out.get(key, 0)\n    return out",
    "    parts = {arg}.split(',')\n    return [int(p) for p in parts[1:]]",
    "    return [x * 2 for x in {arg} if x > 0] + [{arg}[-1]]",
)
ASKS = ("Review this Python function and point out the bug:", "What is wrong with this code? Suggest a fix:",
        "Code review: find the mistake in this function and rewrite it correctly.",
        "Explain what this function does and whether it has a bug:")


def code_review_prompts(n: int, seed: int = 0) -> list[str]:
    g = random.Random(seed)
    out = []
    for _ in range(n):
        arg = g.choice(("values", "items", "data", "numbers", "line", "words"))
        body = g.choice(BODIES).format(arg=arg)
        out.append(f"{g.choice(ASKS)}\n\n```python\ndef {g.choice(NAMES)}({arg}):\n{body}\n```")
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=100, help="code-review prompts (default 100)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    parser.add_argument("--heads", default="eagle", help="comma-separated: eagle, medusa (default eagle)")
    add_common_arguments(parser, repeats=1, cpu_only=True, plot=False)


def main(args) -> int:
    from specdec_ext.engine import SpeculativeDecoder
    from specdec_ext.factory import load, make_drafter, prompt_ids
    from specdec_ext.models import default_model_path
    from specdec_ext.online_training import OnlineDraftTraining

    path = default_model_path()
    target, tokenizer = load(path, torch.device("cpu"))
    prompts = [prompt_ids(tokenizer, p) for p in code_review_prompts(args.prompts)]
    plain = SpeculativeDecoder(target, None, max_batch_size=1).generate_autoregressive(prompts, args.new_tokens)
    heads = args.heads.split(",")
    wrong = [h for h in heads if h not in ("eagle", "medusa")]
    if wrong:
        raise ValueError(f"--heads: {', '.join(map(repr, wrong))} not among eagle, medusa")
    rows = []
    for head in heads:
        for mode in ("frozen", "online"):
            training = OnlineDraftTraining() if mode == "online" else None
            dec = SpeculativeDecoder(target, make_drafter(head, target, path), 4, adaptive=False, max_batch_size=1,
                                     online_draft_training=training)
            lengths, sequences = [], []
            t0 = time.perf_counter()
            for prompt in prompts:  # one after another: the head learns from the earlier ones
                out = dec.generate([prompt], args.new_tokens)
                lengths.append(out.stats.mean_acceptance_length)
                sequences += out.sequences
            seconds = time.perf_counter() - t0
            last = lengths[-20:]
            row = {"head": head, "mode": mode, "prompts": len(prompts),
                   "mean_acceptance_length_all": sum(lengths) / len(lengths),
                   "mean_acceptance_length_last20": sum(last) / len(last), "seconds": seconds,
                   "updates": training.updates if training else 0,
                   "train_share": training.train_s / seconds if training else 0.0,
                   "same_as_plain": sequences == plain.sequences}
            rows.append(row)
            print_row(row)
        frozen, online = rows[-2:]
        for row in (frozen, online):
            row["vs_frozen_last20"] = row["mean_acceptance_length_last20"] / frozen["mean_acceptance_length_last20"]
    report(f"online draft training on {len(prompts)} code-review prompts (B = 1, greedy, k = 4, float32)", rows,
           ["head", "mode", "mean_acceptance_length_all", "mean_acceptance_length_last20", "seconds", "updates",
            "train_share", "vs_frozen_last20", "same_as_plain"])
    save(args, {"title": "online draft training", "prompts": len(prompts), "new_tokens": args.new_tokens,
                "threads": torch.get_num_threads()}, rows, ["head", "mode"])
    return 0

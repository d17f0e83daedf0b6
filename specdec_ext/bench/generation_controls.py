"""What the generation controls cost: a decoding round with every control on against none, at a batch of B.

The shipped SmolLM2-135M-Instruct (kept as Q4_1 with 8-bit activations on the CPU, float32 otherwise), B held-out chat
prompts decoded at once for --new-tokens tokens, the shipped EAGLE head drafting k = 4 every round (adaptive k off:
every round verifies a block of 5 rows per request), greedy and sampled (temperature 0.7, top-p 0.9). "all" turns on
repetition / presence / frequency penalties, a logit bias on three tokens, three bad words (tokenised as vLLM does),
min_tokens, min_p, logprobs with 5 alternatives and a stop string; "none" turns on nothing. The controls change the
tokens (and so the acceptance), so the figure compared is the time per round: elapsed / rounds, the median of
--repeats after a warm-up, the two settings alternating; "sample_ms" is the part after the target's forward (the
controls' processing, the sampling op, the truncation and the round's read).
"""
import statistics
import time

import torch

from .common import add_common_arguments, print_row, report, save

SAMPLING = {"greedy": {}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def all_controls(tokenizer) -> dict:
    return dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1,
                logit_bias={tokenizer.encode(w, add_special_tokens=False)[0]: -2.0 for w in (" very", " really",
                                                                                              " just")},
                bad_words=["obviously", "Certainly", "As an AI"], min_tokens=8, min_p=0.05, logprobs=5,
                stop=["\nUser:"], tokenizer=tokenizer)


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=8, help="requests decoded at once (default 8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--sampling", default="greedy,sampled", help="comma-separated: greedy, sampled")
    add_common_arguments(parser, repeats=3, plot=False)


def main(args) -> int:
    from specdec_ext.draft_data import heldout_chat_prompts
    from specdec_ext.engine import SpeculativeDecoder
    from specdec_ext.factory import choose_device, load, make_drafter, prompt_ids
    from specdec_ext.models import default_model_path

    wrong = [v for v in args.sampling.split(",") if v not in SAMPLING]
    if wrong:
        raise ValueError(f"--sampling: {', '.join(map(repr, wrong))} not among {', '.join(SAMPLING)}")
    device = choose_device(args.device)
    path = default_model_path()
    kept = device.type == "cpu"
    target, tokenizer = load(path, device, keep_quantized=kept)
    prompts = [prompt_ids(tokenizer, r["prompt"]) for r in heldout_chat_prompts()[:args.batch]]
    dec = SpeculativeDecoder(target, make_drafter("eagle", target, path), 4, adaptive=False,
                             max_batch_size=args.batch)
    controls = {"none": {}, "all": all_controls(tokenizer)}
    rows = []
    for mode in args.sampling.split(","):
        sampling = SAMPLING[mode]
        runs = {name: [] for name in controls}
        for name, given in controls.items():  # warm-up (graphs, the controls' buffers)
            dec.generate(prompts, 8, seed=0, **sampling, **given)
        for _ in range(args.repeats):
            for name, given in controls.items():  # alternating, so that a slow spell hits both
                t0 = time.perf_counter()
                out = dec.generate(prompts, args.new_tokens, seed=list(range(len(prompts))), **sampling, **given)
                seconds = time.perf_counter() - t0
                rounds = max(s.target_forwards for s in out.request_stats)
                runs[name].append((seconds / rounds, out.stats.sample_s / rounds, out.stats.mean_acceptance_length))
        per_round = {name: statistics.median(r[0] for r in runs[name]) for name in controls}
        for name in controls:
            row = {"weights": "kept-Q4_1" if kept else "float32", "device": device.type, "sampling": mode,
                   "controls": name, "batch": args.batch,
                   "round_ms": per_round[name] * 1e3,
                   "sample_ms": statistics.median(r[1] for r in runs[name]) * 1e3,
                   "mean_acceptance_length": runs[name][-1][2],
                   "vs_none": per_round[name] / per_round["none"]}
            rows.append(row)
            print_row(row)
    report(f"generation controls: a round at B = {args.batch}, EAGLE k = 4", rows,
           ["weights", "device", "sampling", "controls", "round_ms", "sample_ms", "mean_acceptance_length",
            "vs_none"])
    save(args, {"title": "generation controls: cost per round", "batch": args.batch, "new_tokens": args.new_tokens,
                "threads": torch.get_num_threads()}, rows, ["weights", "device", "sampling", "controls"])
    return 0

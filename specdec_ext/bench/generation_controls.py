"""What the generation controls cost: a decoding round with every control on against none, at a batch of B.

The shipped SmolLM2-135M-Instruct (kept as Q4_1 with 8-bit activations on the CPU, float32 otherwise), B held-out chat
prompts decoded at once for --new-tokens tokens, the shipped EAGLE head drafting k = 4 every round (adaptive k off:
every round verifies a block of 5 rows per request), greedy and sampled (temperature 0.7, top-p 0.9). "all" turns on
repetition / presence / frequency penalties, a logit bias on three tokens, three bad words (tokenised as vLLM does),
min_tokens, min_p, logprobs with 5 alternatives and a stop string; "none" turns on nothing. The controls change the
tokens (and so the acceptance), so the figure compared is the time per round: elapsed / rounds, the median of
--repeats after a warm-up, the two settings alternating, with its phases (GenerationStats): draft (the drafter, its
rows processed), verify (the target's forward), sample (the block's processing, the sampling op, the truncation, the
round's read and the logprobs), other (admission, the host's bookkeeping: stop strings, the controls' uploads).
"vs_none" is the round's ratio; "controls_share" the controls' own time, the phases but the forward (which the
controls do not touch, and whose run-to-run spread on a loaded CPU is larger than their cost), over the round without
them.
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
                st = out.stats
                runs[name].append({"round": seconds, "draft": st.draft_s, "verify": st.verify_s, "sample": st.sample_s,
                                   "other": seconds - st.draft_s - st.verify_s - st.sample_s,
                                   "mal": st.mean_acceptance_length, "rounds": rounds})
        ms = {name: {phase: statistics.median(r[phase] / r["rounds"] for r in runs[name]) * 1e3
                     for phase in ("round", "draft", "verify", "sample", "other")} for name in controls}
        for name in controls:
            own = ms[name]["round"] - ms[name]["verify"]
            row = {"weights": "kept-Q4_1" if kept else "float32", "device": device.type, "sampling": mode,
                   "controls": name, "batch": args.batch, **{f"{k}_ms": v for k, v in ms[name].items()},
                   "mean_acceptance_length": statistics.median(r["mal"] for r in runs[name]),
                   "vs_none": ms[name]["round"] / ms["none"]["round"],
                   "controls_share": (own - (ms["none"]["round"] - ms["none"]["verify"])) / ms["none"]["round"]}
            rows.append(row)
            print_row(row)
    report(f"generation controls: a round at B = {args.batch}, EAGLE k = 4", rows,
           ["weights", "device", "sampling", "controls", "round_ms", "draft_ms", "verify_ms", "sample_ms", "other_ms",
            "mean_acceptance_length", "vs_none", "controls_share"])
    save(args, {"title": "generation controls: cost per round", "batch": args.batch, "new_tokens": args.new_tokens,
                "threads": torch.get_num_threads()}, rows, ["weights", "device", "sampling", "controls"])
    return 0

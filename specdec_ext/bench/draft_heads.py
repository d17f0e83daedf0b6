"""The shipped draft heads on held-out chat prompts (never trained on): acceptance and speed against our plain decoding.

B = 1, each prompt decoded alone for --new-tokens tokens (past EOS: every run emits the same count), on the shipped
SmolLM2-135M-Instruct as float32 and kept as Q4_1 with 8-bit activations (the CPU default for a kept model). Rows: each
head and shape (EAGLE chains of k = 4 and adaptive, EAGLE trees (the default TreeSettings) fixed and adaptive, Medusa
the same), greedy and sampled (temperature 0.7, top-p 0.9, rejection sampling). Speed: tokens/s over the prompts,
speculative and plain alternating per repeat (the median of --repeats after a warm-up), and their ratio; acceptance:
the mean acceptance length (tokens emitted per target forward of a drafting round) and the acceptance per position.
Greedy rows also check that the tokens are plain decoding's.
"""
import statistics
import time

import torch

from .common import add_common_arguments, print_row, report, save

WEIGHTS = ("float32", "kept-Q4_1")
SAMPLING = {"greedy": {}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", type=int, default=16, help="held-out chat prompts (default 16, the set has 60)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    parser.add_argument("--weights", default=",".join(WEIGHTS), help=f"comma-separated, of {', '.join(WEIGHTS)}")
    parser.add_argument("--heads", default="eagle,medusa",
                        help="comma-separated drafter specs: eagle, medusa (the shipped heads), or any other --drafter "
                             "spelling that needs no draft model (self: self-speculative)")
    parser.add_argument("--sampling", default="greedy,sampled", help="comma-separated: greedy, sampled")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    add_common_arguments(parser, repeats=3, cpu_only=True, plot=False)


SHAPES = ("chain k=4", "chain adaptive", "tree", "tree adaptive")


def settings_of(shape: str) -> dict:
    """A row's SpeculativeDecoder settings: chains of k = 4 or adaptive k (up to 8), the default TreeSettings."""
    from specdec_ext.trees import TreeSettings

    tree = dict(tree=TreeSettings()) if shape.startswith("tree") else dict(num_speculative_tokens=4)
    return {**tree, "adaptive": shape.endswith("adaptive"), **({"num_speculative_tokens": 8}
                                                              if shape == "chain adaptive" else {})}


def main(args) -> int:
    from specdec_ext.draft_data import heldout_chat_prompts
    from specdec_ext.engine import SpeculativeDecoder
    from specdec_ext.factory import load, make_drafter, prompt_ids
    from specdec_ext.models import default_model_path

    path, new_tokens, rows = default_model_path(), args.new_tokens, []
    for flag, values, allowed in (("--weights", args.weights, WEIGHTS), ("--shapes", args.shapes, SHAPES),
                                  ("--sampling", args.sampling, SAMPLING)):
        wrong = [v for v in values.split(",") if v not in allowed]
        if wrong:
            raise ValueError(f"{flag}: {', '.join(map(repr, wrong))} not among {', '.join(allowed)}")
    for weights in args.weights.split(","):
        target, tokenizer = load(path, torch.device("cpu"), keep_quantized=weights == "kept-Q4_1")
        prompts = [prompt_ids(tokenizer, r["prompt"]) for r in heldout_chat_prompts()[:args.prompts]]
        plain = SpeculativeDecoder(target, None, max_batch_size=1)
        for mode in args.sampling.split(","):
            sampling = SAMPLING[mode]

            def decode(decoder, speculative: bool):
                # One slot: the prompts one after another, each alone (B = 1); the stats add up over them.
                out = (decoder.generate if speculative else decoder.generate_autoregressive)(
                    prompts, new_tokens, seed=list(range(len(prompts))), **sampling)
                return out.sequences, out.stats

            for head in args.heads.split(","):
                drafter = make_drafter(head, target, path)
                for label in args.shapes.split(","):
                    dec = SpeculativeDecoder(target, drafter, max_batch_size=1, **settings_of(label))
                    dec.generate([prompts[0]], 16, **sampling)  # warm-up (and the cost model's calibration)
                    plain.generate_autoregressive([prompts[0]], 16, **sampling)
                    spec_s, plain_s = [], []
                    for _ in range(args.repeats):  # alternating, so that a slow spell hits both
                        t0 = time.perf_counter()
                        spec_tokens, stats = decode(dec, True)
                        t1 = time.perf_counter()
                        plain_tokens, _ = decode(plain, False)
                        spec_s.append(t1 - t0)
                        plain_s.append(time.perf_counter() - t1)
                    spec_s, plain_s = statistics.median(spec_s), statistics.median(plain_s)
                    n = len(prompts) * new_tokens
                    row = {"weights": weights, "sampling": mode, "head": head, "shape": label,
                           "spec_tok_s": n / spec_s, "plain_tok_s": n / plain_s,
                           "speedup": plain_s / spec_s, "mean_acceptance_length": stats.mean_acceptance_length,
                           "acceptance_per_position": "/".join(
                               f"{a:.2f}" for a in stats.acceptance_rate_per_position[:4]),
                           "same_as_plain": spec_tokens == plain_tokens if mode == "greedy" else "-"}
                    rows.append(row)
                    print_row(row)
    report(f"held-out chat ({args.prompts} prompts), B = 1, {new_tokens} tokens each", rows,
           ["weights", "sampling", "head", "shape", "spec_tok_s", "plain_tok_s", "speedup", "mean_acceptance_length",
            "acceptance_per_position", "same_as_plain"])
    save(args, {"title": "draft heads on held-out chat", "prompts": args.prompts, "new_tokens": new_tokens,
                "threads": torch.get_num_threads()}, rows, ["weights", "sampling", "head", "shape"])
    return 0

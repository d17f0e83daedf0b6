"""`specdec generate`: text in, text out, streamed, through speculative decoding of any supported model."""
import argparse
import sys
import time
from pathlib import Path

from ..drafters.registry import drafters, spelled
from ..engine.decoder import DEFAULT_SAMPLING, SAMPLING_MODES
from ..factory import check_drafter
from .common import UsageError, tree_settings


def validate(args) -> None:
    """What `specdec generate` checks before loading anything (cli.main runs it; the numeric ranges are
    cli/checks.py's)."""
    drafter = args.drafter or ("ngram" if args.model else "eagle")
    entry = check_drafter(drafter, args.model)
    if args.tree is not None and not entry.draws_trees:
        trees = spelled([e.name for e in drafters() if e.draws_trees])
        raise ValueError(f"--tree: tree rounds need {trees} drafting, not {entry.help}")
    if not args.chat and args.prompt == "":
        raise ValueError("--prompt is empty (without --chat there is nothing to continue)")
    if args.keep_quantized and args.model and not str(args.model).endswith(".gguf") and \
            not any(Path(args.model).glob("*.gguf")):
        raise ValueError("--keep-quantized: --model must be a .gguf file (its block weights are what is kept)")
    if args.activations == "int8" and not args.keep_quantized:
        raise ValueError("--activations int8: needs --keep-quantized (the integer kernels multiply block weights)")
    if args.draft_keep_quantized and not entry.needs_draft_model:
        models = spelled([f"{e.syntax} ({e.help})" for e in drafters() if e.needs_draft_model])
        raise ValueError(f"--draft-keep-quantized: the drafter must be {models}")


def stats_line(s, drafter: str, shape: str, seconds: float, finish_reason=None) -> str:
    """The final line of `specdec generate`: throughput, acceptance, calibration time and why generation stopped."""
    extra = f"; cost-model calibration {s.calibration_s:.2f} s, not counted" if s.calibration_s >= 0.005 else ""
    end = f"; finished: {finish_reason}" if finish_reason else ""
    return (f"[{drafter} drafter, {shape}: {s.generated_tokens} tokens in {seconds:.2f} s, "
            f"{s.tokens_per_second:.1f} tokens/s{extra}; acceptance rate {s.acceptance_rate:.2f}, mean acceptance "
            f"length {s.mean_acceptance_length:.2f}{end}]")


def main(args) -> int:
    from ..engine import SpeculativeDecoder
    from ..factory import choose_device, load, make_drafter, prompt_ids
    from ..models import default_model_path

    device = choose_device(args.device)
    path = args.model or default_model_path()
    model, tokenizer = load(path, device, keep_quantized=args.keep_quantized, activations=args.activations)
    drafter = args.drafter or ("ngram" if args.model else "eagle")
    ids = prompt_ids(tokenizer, args.prompt, args.chat)
    if not ids:
        raise UsageError("--prompt encodes to no tokens")
    context = model.config.max_position_embeddings
    if len(ids) >= context:
        raise UsageError(f"--prompt is {len(ids)} tokens; the model's context is {context} tokens")
    dec = SpeculativeDecoder(model, make_drafter(drafter, model, path, args.draft_keep_quantized), args.k,
                             tree=args.tree, max_batch_size=args.max_batch_size, adaptive=not args.no_adaptive,
                             sampling=args.sampling)
    def text_stream(r, piece):
        print(piece, end="", flush=True)

    t0 = time.perf_counter()
    out = dec.generate([ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer,
                       text_stream=text_stream, **controls(args))
    seconds = time.perf_counter() - t0
    print(flush=True)
    if out.logprobs is not None:
        print_logprobs(out.sequences[0], out.logprobs[0], tokenizer)
    adaptive = "fixed" if args.no_adaptive else "adaptive"
    shape = f"k <= {args.k}, {adaptive}" if dec.tree is None else \
        f"trees of <= {dec.tree.num_nodes} nodes, depth {dec.tree.depth}, branching {dec.tree.branching}, {adaptive}"
    print(stats_line(out.stats, drafter, shape, seconds, out.finish_reasons[0]), file=sys.stderr)
    drafter_stats = getattr(dec.drafter, "stats", None)
    if drafter_stats is not None:  # Lookahead's own counts
        print(f"[{drafter_stats.summary()}]", file=sys.stderr)
    return 0


def controls(args) -> dict:
    """The generation controls of `specdec generate`'s flags (engine/controls.py)."""
    return dict(repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, min_p=args.min_p, min_tokens=args.min_tokens,
                logit_bias=dict(args.logit_bias or []), bad_words=args.bad_words or None, stop=args.stop or None,
                include_stop_str_in_output=args.include_stop, logprobs=args.logprobs)


def print_logprobs(tokens: list, logprobs: list, tokenizer) -> None:
    """A line per generated token on stderr: its text, log-probability, rank and the alternatives."""
    for token, entry in zip(tokens, logprobs):
        alternatives = "  ".join(f"{tokenizer.decode([t])!r} {lp:.3f}" for t, lp in entry.top)
        print(f"{tokenizer.decode([token])!r:>16} {entry.logprob:8.3f}  rank {entry.rank:<5} {alternatives}",
              file=sys.stderr)


def logit_bias_entry(text: str) -> tuple:
    """--logit-bias TOKEN_ID=BIAS -> (int, float)."""
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 1234=-5.0), got {text!r}") from None


def tree_drafters() -> str:
    """The drafters that draw --tree's trees, for its help: 'eagle, medusa, ngram; lookahead always runs its own'."""
    chosen = ", ".join(e.name for e in drafters() if e.draws_trees and not e.runs_own_trees)
    own = [e.name for e in drafters() if e.runs_own_trees]
    if not own:
        return chosen
    return f"{chosen}; {spelled(own)} always {'runs its own' if len(own) == 1 else 'run their own'}"


def register(sub) -> None:
    p = sub.add_parser("generate", help="stream text from a model through speculative decoding")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the shipped SmolLM2-135M)")
    p.add_argument("--drafter", default=None,
                   help=f"{spelled([e.help_line() for e in drafters()])}. Default: eagle for the default model, "
                        f"ngram otherwise")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampling", default=DEFAULT_SAMPLING, choices=sorted(SAMPLING_MODES),
                   help="how sampled tokens are verified: invariant (Gumbel coupling: the tokens plain sampling with "
                        "this seed gives, whatever the drafter), rejection (min(1, p/q), draft by draft) or block "
                        "(block verification: the drafts judged jointly, chains only; default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= MIN_P * max p; 0: off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide a positive logit, multiply a negative one, of every token of the prompt and the "
                        "output (transformers' definition); 1: off")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logit of every token the output holds (OpenAI's); 0: off")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times its count in the output from a token's logit (OpenAI's); 0: off")
    p.add_argument("--logit-bias", action="append", type=logit_bias_entry, metavar="TOKEN_ID=BIAS",
                   help="add BIAS to a token's logit (repeatable)")
    p.add_argument("--bad-words", action="append", metavar="WORD",
                   help="never generate this word (tokenised with and without a leading space; repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence token before this many tokens")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="end the output where this text appears (excluded unless --include-stop; repeatable)")
    p.add_argument("--include-stop", action="store_true", help="keep the --stop text that ended the output")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's log-probability, its rank and the N most likely tokens to stderr")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens (largest k; adaptive below it)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="draft k tokens every round (default: adaptive k, from the acceptance rate and the measured "
                        "cost of a draft step)")
    p.add_argument("--max-batch-size", type=int, default=1,
                   help="requests decoded at once (default 1: the command decodes one prompt)")
    p.add_argument("--tree", default=None, type=tree_settings,
                   help=f"tree rounds ({tree_drafters()}): N (nodes per tree, the last token included) or "
                        f"nodes=N,depth=D,branching=K (any of them; the rest default); the node budget adapts below N")
    p.add_argument("--keep-quantized", action="store_true",
                   help="a .gguf model's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights stay as stored (4-8 bits a weight read per "
                        "step instead of 32)")
    p.add_argument("--activations", default=None, choices=["float", "int8"],
                   help="how weights kept quantised multiply: int8 (activations quantised to 8 bits per 32 values, "
                        "integer dot products; the default on the CPU) or float")
    p.add_argument("--draft-keep-quantized", action="store_true",
                   help="the same for a model:PATH draft model (set apart from the target's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(fn=main, validate=validate)

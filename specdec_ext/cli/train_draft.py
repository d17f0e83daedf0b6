"""`specdec train-draft`: trains an EAGLE head or Medusa heads for a model by self-distillation (specdec_ext/
training.py), then measures them on the held-out prompts as loaded from the file written."""
import time
from pathlib import Path

from ..drafters.registry import drafters


def main(args) -> int:
    import torch

    from ..factory import choose_device, load, make_drafter, prompt_ids
    from ..models import default_model_path
    from ..training import DistillationData, distillation_data, draft_vocabulary, evaluate, load_prompts, train

    device = choose_device(args.device)
    target, tokenizer = load(args.model or default_model_path(), device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "data.pt"
    t0 = time.perf_counter()
    if cache.exists():
        data = DistillationData(**torch.load(cache, weights_only=False))
    else:
        prompts = load_prompts("train")[: args.limit or None]
        data = distillation_data(target, [prompt_ids(tokenizer, p["prompt"]) for p in prompts], args.max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, sampled_answers=args.sampled_answers)
        torch.save(vars(data), cache)
    print(f"data: {len(data.tokens)} sequences, {data.num_tokens} tokens ({time.perf_counter() - t0:.0f} s)")
    vocab = draft_vocabulary(data, args.vocab_size, target.config.vocab_size)
    t0 = time.perf_counter()
    train(args.kind, target, data, vocab.to(device), out_dir=out, epochs=args.epochs, lr=args.lr,
          tokens_per_batch=args.tokens_per_batch, unroll=args.unroll, num_heads=args.k,
          save_dtype=getattr(torch, args.save_dtype))
    path = out / f"{args.kind}.safetensors"
    print(f"trained {args.kind} in {time.perf_counter() - t0:.0f} s: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    heldout = [prompt_ids(tokenizer, p["prompt"]) for p in load_prompts("heldout")][: args.eval_prompts]
    # Evaluated as loaded from the file (its weights in save_dtype), as users get it: --drafter KIND:PATH's drafter.
    drafter = make_drafter(f"{args.kind}:{path}", target)
    st = evaluate(target, drafter, heldout, k=args.k, eos_token_id=tokenizer.eos_token_id)
    print(f"held-out ({len(heldout)} prompts, greedy, k = {args.k}): mean acceptance length "
          f"{st.mean_acceptance_length:.2f}, acceptance rate {st.acceptance_rate:.2f}, accepted per position "
          f"{st.accepted_per_position}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE head or Medusa heads by self-distillation")
    # The drafters whose heads this command makes (their registry entries' trained_heads).
    p.add_argument("--kind", choices=[e.name for e in drafters() if e.trained_heads], required=True)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the shipped SmolLM2-135M)")
    p.add_argument("--out", required=True, help="output folder: the head, checkpoints, data cache, loss curve")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens-per-batch", type=int, default=512)
    p.add_argument("--unroll", type=int, default=1, help="EAGLE: draft steps unrolled in training (1: EAGLE-1)")
    p.add_argument("--vocab-size", type=int, default=16384, help="draft vocabulary: the most frequent tokens")
    p.add_argument("--max-new-tokens", type=int, default=192, help="length of the target's answers")
    p.add_argument("--sampled-answers", type=int, default=2,
                   help="answers per prompt drawn at temperature 0.8, besides the greedy one")
    p.add_argument("--limit", type=int, default=0, help="train on the first N prompts only (0: all)")
    p.add_argument("-k", type=int, default=4, help="Medusa heads; k of the held-out evaluation")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the weights in the head's file")
    p.add_argument("--device", default=None)
    p.set_defaults(fn=main)

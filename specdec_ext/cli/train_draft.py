"""`specdec train-draft`: trains an EAGLE head (EAGLE-3 features by default) or Medusa heads for a model on data
that `specdec draft-data` made (specdec_ext/training.py), measuring them on the held-out chat prompts after each
epoch and at the end, as loaded from the file written."""
import json
import time
from pathlib import Path

from ..drafters.registry import drafters

VOCAB_SIZES = (4096, 8192, 12288, 16384, 24576, 32768)  # the draft vocabularies --vocab-size 0 chooses among


def main(args) -> int:
    import torch

    from ..draft_data import DraftData, heldout_chat_prompts
    from ..factory import choose_device, load, make_drafter, prompt_ids
    from ..models import default_model_path
    from ..models.draft_heads import eagle3_layers
    from ..training import TargetFeatures, draft_vocabulary, evaluate, feature_columns, train, vocabulary_coverage

    device = choose_device(args.device)
    model = args.model or default_model_path()
    # As `specdec draft-data` generates: on the CPU the GGUF weights kept, on the integer kernels (the features the
    # head sees when it drafts for that target, the CPU's default).
    target, tokenizer = load(model, device, keep_quantized=device.type == "cpu" and str(model).endswith(".gguf"))
    data = DraftData.load(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eagle3 = args.kind == "eagle" and args.features in (None, "eagle3")
    layers = eagle3_layers(target.config.num_hidden_layers) if eagle3 else None
    t0 = time.perf_counter()
    features = TargetFeatures.build(target, data, out / "features", feature_columns(target, layers))
    print(f"data: {len(data)} sequences, {len(data.tokens):,} tokens; features ({features.layers}) in "
          f"{time.perf_counter() - t0:.0f} s")
    coverage = vocabulary_coverage(data, VOCAB_SIZES, target.config.vocab_size)
    print("draft vocabulary coverage of the validation answers: " +
          ", ".join(f"{size}: {share:.4f}" for size, share in coverage.items()))
    size = args.vocab_size or next((s for s, share in coverage.items() if share >= args.coverage), VOCAB_SIZES[-1])
    vocab = draft_vocabulary(data, size, target.config.vocab_size)
    heldout = [prompt_ids(tokenizer, r["prompt"]) for r in heldout_chat_prompts()][: args.eval_prompts]
    results = []

    def measure(path) -> dict:
        # As users get it: --drafter KIND:PATH's drafter, the weights as the file holds them.
        st = evaluate(target, make_drafter(f"{args.kind}:{path}", target), heldout, k=args.k,
                      eos_token_id=tokenizer.eos_token_id)
        return {"mean_acceptance_length": round(st.mean_acceptance_length, 3),
                "acceptance_per_position": [round(a, 3) for a in st.acceptance_rate_per_position]}

    def on_epoch(epoch, head, summary):
        if not heldout:
            return
        path = out / f"{args.kind}_epoch.safetensors"
        head.save(path, getattr(torch, args.save_dtype))
        summary["heldout"] = measure(path)
        results.append(summary)
        print(f"epoch {epoch}: {json.dumps(summary)}", flush=True)

    t0 = time.perf_counter()
    train(args.kind, target, features, vocab.to(device), out_dir=out, epochs=args.epochs, lr=args.lr,
          tokens_per_batch=args.tokens_per_batch, unroll=args.unroll, feature_layers=layers, num_heads=args.k,
          save_dtype=getattr(torch, args.save_dtype), resume=args.resume, on_epoch=on_epoch,
          autocast=None if args.autocast == "none" else getattr(torch, args.autocast))
    path = out / f"{args.kind}.safetensors"
    print(f"trained {args.kind} (draft vocabulary {len(vocab)}) in {time.perf_counter() - t0:.0f} s: {path} "
          f"({path.stat().st_size / 2**20:.1f} MiB)")
    if heldout:
        print(f"held-out chat ({len(heldout)} prompts, greedy, k = {args.k}, 128 tokens): {json.dumps(measure(path))}")
    return 0


def check(args) -> None:
    if not 0 < args.coverage <= 1:
        raise ValueError(f"--coverage must be in (0, 1], got {args.coverage}")
    if args.features == "eagle3" and args.kind != "eagle":
        raise ValueError("--features eagle3: EAGLE heads only (Medusa heads read the last layer)")


def register(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE head or Medusa heads on `specdec draft-data`'s data")
    # The drafters whose heads this command makes (their registry entries' trained_heads).
    p.add_argument("--kind", choices=[e.name for e in drafters() if e.trained_heads], required=True)
    p.add_argument("--data", required=True, help="a draft_data.safetensors that `specdec draft-data` wrote")
    p.add_argument("--out", required=True, help="output folder: the head, checkpoints, target features, loss curve")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the shipped SmolLM2-135M)")
    p.add_argument("--features", choices=("eagle3", "last"), default=None,
                   help="EAGLE: the target's low, middle and high layers (eagle3, the default) or its last (EAGLE-1)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens-per-batch", type=int, default=2048)
    p.add_argument("--unroll", type=int, default=3,
                   help="EAGLE-3: draft steps unrolled in training (its training-time test)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="draft vocabulary: the most frequent tokens (0: the smallest of "
                        f"{', '.join(map(str, VOCAB_SIZES))} covering --coverage of the validation answers)")
    # 95%: on the shipped model 8,192 tokens; 98% would take 16,384, whose LM-head rows double a draft step's cost
    # and a training step's (bench/RESULTS.md).
    p.add_argument("--coverage", type=float, default=0.95)
    p.add_argument("-k", type=int, default=4, help="Medusa heads; k of the held-out evaluation")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out chat prompts measured after each epoch")
    p.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the weights in the head's file")
    p.add_argument("--autocast", default="bfloat16", choices=("bfloat16", "none"),
                   help="the matrix products' dtype in training (the weights stay in the target's)")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--device", default=None)
    p.set_defaults(fn=main, validate=check)

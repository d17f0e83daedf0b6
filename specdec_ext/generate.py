"""`specdec generate`: text in, text out, streamed, through speculative decoding of any supported model."""
import sys
import time
from pathlib import Path


def load(path, device):
    """A model and its tokenizer from an HF directory or a .gguf file, with a progress bar."""
    from tqdm import tqdm

    from .models import LlamaForCausalLM, load_tokenizer

    with tqdm(total=2, desc=f"loading {path}", unit="part", file=sys.stderr, leave=False) as bar:
        model = LlamaForCausalLM.from_pretrained(path, device=device)
        bar.update()
        tokenizer = load_tokenizer(path)
        bar.update()
    return model, tokenizer


def make_drafter(spec: str, target, model_path=None):
    """'ngram', 'model:PATH' (a draft model), 'eagle[:PATH]' or 'medusa[:PATH]' (trained heads for the target; without
    a PATH, the heads shipped for the default model, when model_path is that model)."""
    from .drafting import EagleDrafter, MedusaDrafter, ModelDrafter, NgramDrafter
    from .models import LlamaForCausalLM, default_head_path, default_model_path
    from .models.draft_heads import EagleHead, MedusaHeads

    kind, _, path = spec.partition(":")
    if spec == "ngram":
        return NgramDrafter()
    if kind == "model" and path:
        return ModelDrafter(LlamaForCausalLM.from_pretrained(path, device=target.device, dtype=target.dtype))
    if kind in ("eagle", "medusa"):
        if not path:
            if model_path is None or Path(model_path).resolve() != default_model_path().resolve():
                raise ValueError(f"--drafter {kind}: heads ship for the default model only; give {kind}:PATH, "
                                 f"made by `specdec train-draft --kind {kind}`")
            path = default_head_path(kind)
        if kind == "eagle":
            return EagleDrafter(target, EagleHead.load(path, target))
        return MedusaDrafter(target, MedusaHeads.load(path, target))
    raise ValueError(f"--drafter must be ngram, model:PATH, eagle[:PATH] or medusa[:PATH], got {spec!r}")


def tree_settings(spec: str):
    """--tree's value as TreeSettings (argparse reports a bad one as a usage error)."""
    import argparse

    from .trees import TreeSettings

    try:
        return TreeSettings.of(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def prompt_ids(tokenizer, text: str, chat: bool) -> list:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]


def main(args) -> int:
    import torch

    from .decoding import SpeculativeDecoder
    from .models import default_model_path

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = args.model or default_model_path()
    model, tokenizer = load(path, device)
    drafter = args.drafter or ("ngram" if args.model else "eagle")
    dec = SpeculativeDecoder(model, make_drafter(drafter, model, path), args.k, tree=args.tree)
    ids = prompt_ids(tokenizer, args.prompt, args.chat)
    t0 = time.perf_counter()
    out = dec.generate([ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eos_token_id=tokenizer.eos_token_id,
                       stream=lambda r, new: print(tokenizer.decode(new, skip_special_tokens=True), end="", flush=True))
    s = out.stats
    shape = f"k <= {args.k}" if dec.tree is None else \
        f"trees of <= {dec.tree.num_nodes} nodes, depth {dec.tree.depth}, branching {dec.tree.branching}"
    print(f"\n[{drafter} drafter, {shape}: {s.generated_tokens} tokens in {time.perf_counter() - t0:.2f} s, "
          f"{s.tokens_per_second:.1f} tokens/s; acceptance rate {s.acceptance_rate:.2f}, mean acceptance length "
          f"{s.mean_acceptance_length:.2f}]",
          file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("generate", help="stream text from a model through speculative decoding")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the shipped SmolLM2-135M)")
    p.add_argument("--drafter", default=None, help="ngram (prompt lookup), model:PATH (a draft model), "
                                                      "eagle[:PATH] or medusa[:PATH] (trained heads; without PATH, the "
                                                      "ones shipped for the default model). Default: eagle for the "
                                                      "default model, ngram otherwise")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens (largest k; adaptive below it)")
    p.add_argument("--tree", default=None, type=tree_settings,
                   help="tree rounds (eagle, medusa, ngram): N (nodes per tree, the last token included) or "
                        "nodes=N,depth=D,branching=K (any of them; the rest default); the node budget adapts below N")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(fn=main)

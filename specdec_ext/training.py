"""Training draft heads by self-distillation: the target answers the shipped prompt set (specdec_ext/data/
prompts.jsonl, its "train" split; "heldout" is never trained on), and its own hidden states and next-token
distributions on those answers are the labels.

  data = distillation_data(target, tokenizer, prompts)           the target's greedy answers and features
  vocab = draft_vocabulary(data, size)                           the most frequent tokens
  head = train_eagle(target, data, vocab, out_dir=...)           or train_medusa(...)

EAGLE loss (Li et al.): smooth L1 between the head's predicted feature of token j+1 and the target's, plus 0.1 x
the cross-entropy of the head's distribution (over the draft vocabulary) against the target's at that token,
with uniform noise on the input features so that the head tolerates its own inexact features at later draft
steps. Medusa loss: cross-entropy of head i against the token i + 1 places ahead, weighted 0.8^(i-1).
Checkpoints (head, optimiser, step) let a run resume; a loss curve is written as PNG.
"""
import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from .decoding import SpeculativeDecoder
from .models.draft_heads import EagleHead, MedusaHeads
from .models.llama import linear, rms_norm


def load_prompts(split: str = "train") -> list[dict]:
    """The shipped prompt set: {"category", "prompt", "split"} rows of the given split ("train", "heldout", "all")."""
    text = resources.files("specdec_ext").joinpath("data/prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if split == "all" or r["split"] == split]


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@dataclass
class DistillationData:
    tokens: list      # per sequence: [L] int64, prompt then the target's answer
    features: list    # per sequence: [L, H], the target's last-layer hidden states (before the final norm)
    answer_start: list  # per sequence: where the answer begins

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@torch.no_grad()
def distillation_data(target, prompt_ids: list, max_new_tokens: int = 192, *, eos_token_id=None,
                      batch_size: int = 8, progress: bool = True) -> DistillationData:
    """The target's greedy answers to prompt_ids (our plain decoding, continuous batching), then one forward per
    sequence for its features."""
    from tqdm import tqdm

    answers = SpeculativeDecoder(target, None, max_batch_size=batch_size).generate_autoregressive(
        prompt_ids, max_new_tokens, eos_token_id=eos_token_id).sequences
    data = DistillationData([], [], [])
    for p, a in tqdm(list(zip(prompt_ids, answers)), desc="target features", disable=not progress):
        seq = torch.tensor(p + a, device=target.device)
        _, hidden = target(seq.unsqueeze(0), None, logits_indices=torch.tensor([len(seq) - 1], device=target.device),
                           output_hidden_states=True)
        data.tokens.append(seq.cpu())
        data.features.append(hidden[0].cpu())
        data.answer_start.append(len(p))
    return data


def draft_vocabulary(data: DistillationData, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the sequences (sorted ids): what the heads score."""
    counts = torch.bincount(torch.cat(data.tokens), minlength=1)
    size = min(size, int((counts > 0).sum()))
    return counts.topk(size).indices.sort().values


def batches(data: DistillationData, tokens_per_batch: int, generator: torch.Generator):
    """Shuffled batches of whole sequences, about tokens_per_batch tokens each, padded to the longest."""
    order = torch.randperm(len(data.tokens), generator=generator).tolist()
    batch, width = [], 0
    for i in order:
        width = max(width, len(data.tokens[i]))
        batch.append(i)
        if width * len(batch) >= tokens_per_batch:
            yield batch
            batch, width = [], 0
    if batch:
        yield batch


def padded(data: DistillationData, idx: list):
    width = max(len(data.tokens[i]) for i in idx)
    tokens = torch.zeros(len(idx), width, dtype=torch.long)
    features = torch.zeros(len(idx), width, data.features[0].shape[-1], dtype=data.features[0].dtype)
    valid = torch.zeros(len(idx), width, dtype=torch.bool)
    for r, i in enumerate(idx):
        n = len(data.tokens[i])
        tokens[r, :n], features[r, :n], valid[r, :n] = data.tokens[i], data.features[i], True
    return tokens, features, valid


def eagle_loss(head: EagleHead, tokens, features, valid, noise: float):
    """Pairs j = (feature j, token j+1) for j < L - 1: the head predicts feature j+1 and the target's distribution
    after token j+1 (from that feature through the final norm and the restricted LM head)."""
    inputs = features[:, :-1] + (torch.rand_like(features[:, :-1]) - 0.5) * 2 * noise
    logits, predicted = head.decoder(None, None, inputs_embeds=head.inputs(tokens[:, 1:], inputs),
                                     output_hidden_states=True)
    want = features[:, 1:]
    mask = valid[:, 1:]
    with torch.no_grad():
        target_logits = linear(rms_norm(want, head.decoder.norm, head.target_config.rms_norm_eps),
                               head.decoder.embed_tokens).float()
        p = target_logits.softmax(-1)
    regression = F.smooth_l1_loss(predicted, want, reduction="none").mean(-1)
    ce = -(p * logits.log_softmax(-1)).sum(-1)
    n = mask.sum().clamp(min=1)
    return (regression * mask).sum() / n, (ce * mask).sum() / n


def medusa_loss(heads: MedusaHeads, tokens, features, valid, remap: torch.Tensor):
    """Head i at token j: cross-entropy against token j + 1 + i (hard labels: the target's greedy answers), when
    that token is inside the sequence and the draft vocabulary; weights 0.8^i."""
    b, length = tokens.shape
    logits = heads(features.flatten(0, 1)).unflatten(0, (b, length))  # [B, L, heads, Vd]
    total, weight_sum = 0.0, 0.0
    for i in range(heads.num_heads):
        shift = 2 + i
        if tokens.shape[1] <= shift:
            break
        label = remap[tokens[:, shift:]]  # -1 outside the draft vocabulary
        ok = valid[:, shift:] & (label >= 0)
        ce = F.cross_entropy(logits[:, :-shift, i].flatten(0, 1), label.clamp(min=0).flatten(), reduction="none")
        total = total + 0.8 ** i * (ce * ok.flatten()).sum() / ok.sum().clamp(min=1)
        weight_sum += 0.8 ** i
    return total / weight_sum


def train(kind: str, target, data: DistillationData, draft_vocab: torch.Tensor, *, out_dir, epochs: int = 8,
          lr: float = 1e-3, tokens_per_batch: int = 2048, noise: float = 0.1, num_heads: int = 4, seed: int = 0,
          checkpoint_every: int = 50, progress: bool = True):
    """Trains an EAGLE head or Medusa heads on `data`; writes out_dir/{kind}.safetensors, a checkpoint to resume
    from, loss.png and log.json. Returns the head."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    if kind == "eagle":
        head = EagleHead(target, draft_vocab).init_weights(g)
        params = [head.fc.weight, head.fc.bias] + [p for p in head.decoder.layers[0].parameters()]
    elif kind == "medusa":
        head = MedusaHeads(target, draft_vocab, num_heads)
        params = [head.weight, head.bias]  # zeros: every head starts as the target's own LM head
    else:
        raise ValueError(f"train: kind must be 'eagle' or 'medusa', got {kind!r}")
    for p in params:
        p.requires_grad_(True)
    optimiser = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps_per_epoch = sum(1 for _ in batches(data, tokens_per_batch, torch.Generator().manual_seed(0)))
    total_steps = epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    checkpoint = out_dir / f"{kind}_checkpoint.pt"
    step, log = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        optimiser.load_state_dict(state["optimiser"])
        schedule.load_state_dict(state["schedule"])
        step, log, g = state["step"], state["log"], state["generator"]
    remap = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    remap[draft_vocab.cpu()] = torch.arange(len(draft_vocab))
    remap = remap.to(target.device)
    start = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc=f"training {kind}", disable=not progress)
    for epoch in range(step // steps_per_epoch, epochs):
        # The epoch's batch order is a function of (seed, epoch): a resumed run sees the same batches.
        order = list(batches(data, tokens_per_batch, torch.Generator().manual_seed(seed * 1000 + epoch)))
        for idx in order[step - epoch * steps_per_epoch:]:
            tokens, features, valid = (t.to(target.device) for t in padded(data, idx))
            if kind == "eagle":
                regression, ce = eagle_loss(head, tokens, features, valid, noise)
                loss = regression + 0.1 * ce
                entry = {"step": step, "loss": loss.item(), "regression": regression.item(), "ce": ce.item()}
            else:
                loss = medusa_loss(head, tokens, features, valid, remap)
                entry = {"step": step, "loss": loss.item()}
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            schedule.step()
            log.append(entry)
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{entry['loss']:.3f}")
            if step % checkpoint_every == 0 or step == total_steps:
                torch.save({"params": [p.detach().clone() for p in params], "optimiser": optimiser.state_dict(),
                            "schedule": schedule.state_dict(), "step": step, "log": log, "generator": g}, checkpoint)
    bar.close()
    for p in params:
        p.requires_grad_(False)
    head.save(out_dir / f"{kind}.safetensors")
    (out_dir / "log.json").write_text(json.dumps({"kind": kind, "steps": step, "tokens": data.num_tokens,
                                                  "seconds": time.perf_counter() - start, "log": log}))
    plot_losses(log, out_dir / f"{kind}_loss.png", kind)
    return head


def plot_losses(log: list, path, kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in [k for k in ("loss", "regression", "ce") if log and k in log[0]]:
        ax.plot([e["step"] for e in log], [e[key] for e in log], label=key, lw=0.8)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.set_title(f"{kind} head training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluate(target, drafter, prompt_ids: list, *, k: int = 4, max_new_tokens: int = 128, eos_token_id=None):
    """Greedy speculative decoding of prompt_ids with fixed k: the stats (mean acceptance length, per position)."""
    dec = SpeculativeDecoder(target, drafter, k, adaptive=False, max_batch_size=min(8, len(prompt_ids)))
    return dec.generate(prompt_ids, max_new_tokens, eos_token_id=eos_token_id).stats


def main(args) -> int:
    import torch

    from .drafting import EagleDrafter, MedusaDrafter
    from .generate import load
    from .models import default_model_path

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target, tokenizer = load(args.model or default_model_path(), device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "data.pt"
    t0 = time.perf_counter()
    if cache.exists():
        data = DistillationData(**torch.load(cache, weights_only=False))
    else:
        prompts = load_prompts("train")[: args.limit or None]
        data = distillation_data(target, [chat_ids(tokenizer, p["prompt"]) for p in prompts], args.max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id)
        torch.save(vars(data), cache)
    print(f"data: {len(data.tokens)} sequences, {data.num_tokens} tokens ({time.perf_counter() - t0:.0f} s)")
    vocab = draft_vocabulary(data, args.vocab_size)
    t0 = time.perf_counter()
    head = train(args.kind, target, data, vocab.to(device), out_dir=out, epochs=args.epochs, lr=args.lr,
                 num_heads=args.k)
    print(f"trained {args.kind} in {time.perf_counter() - t0:.0f} s: {out / (args.kind + '.safetensors')}")
    heldout = [chat_ids(tokenizer, p["prompt"]) for p in load_prompts("heldout")][: args.eval_prompts]
    drafter = EagleDrafter(target, head) if args.kind == "eagle" else MedusaDrafter(target, head)
    st = evaluate(target, drafter, heldout, k=args.k, eos_token_id=tokenizer.eos_token_id)
    print(f"held-out ({len(heldout)} prompts, greedy, k = {args.k}): mean acceptance length "
          f"{st.mean_acceptance_length:.2f}, acceptance rate {st.acceptance_rate:.2f}, accepted per position "
          f"{st.accepted_per_position}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE head or Medusa heads by self-distillation")
    p.add_argument("--kind", choices=("eagle", "medusa"), required=True)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the shipped SmolLM2-135M)")
    p.add_argument("--out", required=True, help="output folder: the head, checkpoints, data cache, loss curve")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary: the most frequent tokens")
    p.add_argument("--max-new-tokens", type=int, default=192, help="length of the target's answers")
    p.add_argument("--limit", type=int, default=0, help="train on the first N prompts only (0: all)")
    p.add_argument("-k", type=int, default=4, help="Medusa heads; k of the held-out evaluation")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--device", default=None)
    p.set_defaults(fn=main)

"""Training draft heads by self-distillation: the target answers the shipped prompt set (specdec_ext/data/
prompts.jsonl, its "train" split; "heldout" is never trained on), greedily and (sampled_answers) at temperature
0.8, and its own hidden states and next-token distributions on those answers are the labels.

  data = distillation_data(target, prompt_ids, sampled_answers=2)   the target's answers and features
  vocab = draft_vocabulary(data, size, vocab_size)                  the most frequent tokens
  head = train("eagle", target, data, vocab, out_dir=...)           or "medusa"

EAGLE loss (Li et al.): smooth L1 between the head's predicted feature of token j+1 and the target's, both through
the target's final norm, plus 0.1 x the cross-entropy of the head's distribution (over the draft vocabulary)
against the target's at that token, with uniform noise on the (normed) input features so that the head tolerates
its own inexact features at later draft steps; unroll > 1 also trains on them (EAGLE-3's training-time test).
Medusa loss: cross-entropy of head i against the token i + 2 places ahead, weighted 0.8^i. Checkpoints (head,
optimiser, schedule, step) let a run resume; a loss curve is written as PNG.
"""
import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from .engine import SpeculativeDecoder
from .models.draft_heads import EagleHead, MedusaHeads
from .models.llama import linear, rms_norm


def load_prompts(split: str = "train") -> list[dict]:
    """The shipped prompt set: {"category", "prompt", "split"} rows of the given split ("train", "heldout", "all")."""
    text = resources.files("specdec_ext").joinpath("data/prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if split == "all" or r["split"] == split]


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
                      sampled_answers: int = 0, temperature: float = 0.8, batch_size: int = 8,
                      progress: bool = True) -> DistillationData:
    """The target's answers to prompt_ids (our plain decoding, continuous batching): its greedy answer to each and
    `sampled_answers` more drawn at `temperature` (seeds 1, 2, ...: more and varied text from the same prompts),
    then one forward per sequence for its features."""
    from tqdm import tqdm

    n = 1 + sampled_answers
    requests = [p for p in prompt_ids for _ in range(n)]
    temperatures = [0.0 if i % n == 0 else temperature for i in range(len(requests))]
    seeds = [i % n for i in range(len(requests))]
    with tqdm(total=len(requests) * max_new_tokens, desc="target answers", unit="tok", disable=not progress) as bar:
        answers = SpeculativeDecoder(target, None, max_batch_size=batch_size).generate_autoregressive(
            requests, max_new_tokens, temperature=temperatures, seed=seeds, eos_token_id=eos_token_id,
            stream=lambda r, new: bar.update(len(new))).sequences
    data = DistillationData([], [], [])
    for p, a in tqdm(list(zip(requests, answers)), desc="target features", disable=not progress):
        seq = torch.tensor(p + a, device=target.device)
        _, hidden = target(seq.unsqueeze(0), None, logits_indices=torch.tensor([len(seq) - 1], device=target.device),
                           output_hidden_states=True)
        data.tokens.append(seq.cpu())
        data.features.append(hidden[0].cpu())
        data.answer_start.append(len(p))
    return data


def draft_vocabulary(data: DistillationData, size: int, vocab_size: int | None = None) -> torch.Tensor:
    """The `size` most frequent tokens of the sequences (sorted ids): what the heads score. When the data hold fewer
    distinct tokens, the lowest ids not in them fill the rest (a BPE vocabulary numbers its tokens in merge order,
    roughly by frequency in the tokenizer's corpus): a head predicts features, so it can propose tokens that the
    data never showed it."""
    counts = torch.bincount(torch.cat(data.tokens), minlength=vocab_size or 1)
    seen = int((counts > 0).sum())
    if vocab_size is None or size <= seen:
        return counts.topk(min(size, seen)).indices.sort().values
    unseen = (counts == 0).nonzero().flatten()[: size - seen]
    return torch.cat(((counts > 0).nonzero().flatten(), unseen)).sort().values


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


def eagle_loss(head: EagleHead, tokens, features, valid, noise: float, unroll: int = 1):
    """Pairs j = (feature j, token j+1) for j < L - 1: the head predicts feature j+1 and the target's distribution
    after token j+1 (from that feature through the final norm and the restricted LM head). The regression is on
    the features through the target's final norm, what the LM head sees: the raw ones' scale means nothing to it.
    unroll > 1 (EAGLE-3's training-time test): step s feeds the head its own step s-1 estimates as the features,
    as a draft's later steps do, and its losses count as much as the first step's."""
    norm, eps = head.decoder.norm, head.target_config.rms_norm_eps
    with torch.no_grad():
        normed = rms_norm(features, norm, eps)
        p = linear(normed, head.decoder.embed_tokens).float().softmax(-1)
    regression = ce = 0.0
    inputs = features[:, :-1]
    steps = min(unroll, tokens.shape[1] - 1)
    for s in range(steps):
        # Step s: pairs j = s .. L-2, each with the head's estimate of feature j after s steps.
        logits, predicted = head.decoder(None, None, inputs_embeds=head.inputs(tokens[:, 1 + s:], inputs, noise),
                                         output_hidden_states=True)
        mask = valid[:, 1 + s:]
        n = mask.sum().clamp(min=1)
        step_regression = F.smooth_l1_loss(rms_norm(predicted, norm, eps), normed[:, 1 + s:], reduction="none")
        regression = regression + (step_regression.mean(-1) * mask).sum() / n
        ce = ce - ((p[:, 1 + s:] * logits.log_softmax(-1)).sum(-1) * mask).sum() / n
        inputs = predicted[:, :-1]
    return regression / steps, ce / steps


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
          lr: float = 1e-3, tokens_per_batch: int = 512, noise: float = 0.1, ce_weight: float = 0.1,
          unroll: int = 1, num_heads: int = 4, seed: int = 0,
          checkpoint_every: int = 50, save_dtype: torch.dtype | None = None, progress: bool = True):
    """Trains an EAGLE head or Medusa heads on `data`; writes out_dir/{kind}.safetensors (weights in save_dtype,
    default the target's), a checkpoint to resume from, {kind}_loss.png and {kind}_log.json. Returns the head."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    if kind == "eagle":
        head = EagleHead(target, draft_vocab).init_weights(g)
        params = [head.fc.weight, head.fc.bias, head.feature_norm] + list(head.decoder.layers[0].parameters())
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
                regression, ce = eagle_loss(head, tokens, features, valid, noise, unroll)
                loss = regression + ce_weight * ce
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
    head.save(out_dir / f"{kind}.safetensors", save_dtype)
    (out_dir / f"{kind}_log.json").write_text(json.dumps({"kind": kind, "steps": step, "tokens": data.num_tokens,
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

"""Training draft heads by self-distillation on the target's own text (specdec_ext/draft_data.py makes it):

  data = DraftData.load(path)                                      token ids: the target's answers, text
  features = TargetFeatures.build(target, data, folder, layers)    its features and next-token top-k, once
  vocab = draft_vocabulary(data, size, vocab_size)                 the most frequent tokens
  head = train("eagle", target, features, vocab, out_dir=...)      or "medusa"

EAGLE-3 (feature_layers given, Li et al. 2025): the head reads the target's low, middle and high layers and is
trained with "training-time test": step s of `unroll` feeds the head its own step s-1 outputs, and attends as a
draft does at its (s+1)-th step (the target-fed pairs up to s places back, then its own draft-step pairs: ttt_forward
reproduces drafting exactly). Loss: the cross-entropy of each step's draft distribution against the target's
(its top-k, renormalised over the draft vocabulary), step s weighted 0.8^s.
EAGLE-1 (the last layer's features): smooth L1 between the head's predicted feature of token j+1 and the
target's, both through the target's final norm, plus 0.1 x the cross-entropy against the target's distribution,
with uniform noise on the normed input features.
Medusa: cross-entropy of head i against the token i + 2 places ahead, weighted 0.8^i.

Checkpoints (head, optimiser, schedule, step) let a run resume to the same weights as an uninterrupted one (the
batch order and the noise are functions of the seed, the epoch and the step); a loss curve is written as PNG and
the validation split's teacher-forced chain acceptance per epoch into the log.
"""
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .draft_data import DraftData, load_prompts  # noqa: F401 (load_prompts: where callers find it)
from .engine import SpeculativeDecoder
from .models.draft_heads import EagleHead, MedusaHeads
from .models.llama import linear, rms_norm, rotary_split, silu_mul

TOP_K = 8  # the target's next-token distribution kept per position: its top 8 (renormalised in the loss)


def feature_columns(target, feature_layers) -> tuple:
    """The layers a feature folder stores: the head's feature layers and the last (EAGLE-1 and Medusa read it)."""
    return tuple(sorted(set(feature_layers or ()) | {target.config.num_hidden_layers - 1}))


class TargetFeatures:
    """DraftData's sequences with the target's features at `layers` (the residual stream after each, side by side,
    float16: [T, len(layers) x H]) and its next-token top-k at every position (ids [T, K] int32, probabilities
    [T, K] float16), in a folder of .npy files read as memory maps. Built once per target and data, resumably."""

    def __init__(self, data: DraftData, folder, layers: tuple, hidden_size: int):
        folder = Path(folder)
        self.data, self.layers, self.hidden_size = data, layers, hidden_size
        self.features = np.load(folder / "features.npy", mmap_mode="r")
        self.top_ids = np.load(folder / "top_ids.npy", mmap_mode="r")
        self.top_probs = np.load(folder / "top_probs.npy", mmap_mode="r")

    @classmethod
    @torch.no_grad()
    def build(cls, target, data: DraftData, folder, layers: tuple, *, tokens_per_batch: int = 2048,
              progress: bool = True) -> "TargetFeatures":
        """Runs every sequence through the target (whole sequences, no cache; batches of similar lengths) into
        `folder`; sequences already done (done.npy) are skipped, so an interrupted build resumes. A folder that
        holds these data's features at more layers than asked serves as it is (Medusa reads EAGLE-3's folder)."""
        from tqdm import tqdm

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        total, width = len(data.tokens), len(layers) * target.config.hidden_size
        meta = {"layers": list(layers), "tokens": total, "sequences": len(data), "top_k": TOP_K,
                "data": data.fingerprint(), "target": target_identity(target)}
        if (folder / "meta.json").exists():
            held = json.loads((folder / "meta.json").read_text())
            if {**held, "layers": meta["layers"]} != meta or not set(layers) <= set(held["layers"]):
                raise ValueError(f"{folder}: features of other data or layers; remove it or choose another folder")
            layers, width = tuple(held["layers"]), len(held["layers"]) * target.config.hidden_size
        if not (folder / "meta.json").exists():
            for name, shape, dtype in (("features", (total, width), np.float16), ("top_ids", (total, TOP_K), np.int32),
                                       ("top_probs", (total, TOP_K), np.float16), ("done", (len(data),), np.bool_)):
                np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=dtype, shape=shape).flush()
            (folder / "meta.json").write_text(json.dumps(meta))
        done = np.load(folder / "done.npy", mmap_mode="r+")
        out = {name: np.load(folder / f"{name}.npy", mmap_mode="r+") for name in ("features", "top_ids", "top_probs")}
        lengths = data.lengths
        order = sorted((i for i in range(len(data)) if not done[i]), key=lambda i: lengths[i])
        bar = tqdm(total=sum(lengths[i] for i in order), desc="target features", unit="tok", disable=not progress)
        while order:
            batch = [order.pop()]  # longest first; then as many as fit
            while order and lengths[batch[0]] * (len(batch) + 1) <= tokens_per_batch:
                batch.append(order.pop())
            tokens, valid = padded_tokens(data, batch)
            logits, hidden = target(tokens.to(target.device), None, output_hidden_states=layers)
            if hidden.float().abs().max() > 65504:  # float16's largest
                raise ValueError("TargetFeatures: the target's features overflow float16; this model's residual "
                                 "stream is too large to store as they are")
            top = logits.softmax(-1).topk(TOP_K)
            for r, i in enumerate(batch):
                a, b, n = int(data.offsets[i]), int(data.offsets[i + 1]), lengths[i]
                out["features"][a:b] = hidden[r, :n].float().cpu().numpy().astype(np.float16)
                out["top_ids"][a:b] = top.indices[r, :n].int().cpu().numpy()
                out["top_probs"][a:b] = top.values[r, :n].cpu().numpy().astype(np.float16)
            for array in out.values():
                array.flush()
            done[batch] = True  # after the values are on disk
            done.flush()
            bar.update(int(valid.sum()))
        bar.close()
        return cls(data, folder, layers, target.config.hidden_size)

    def batch(self, idx: list, layers: tuple, device, dtype):
        """Sequences idx padded to the longest: tokens [B, L] int64, features [B, L, len(layers) x H] (of `layers`,
        a subset of the stored ones), valid [B, L] bool, top_ids [B, L, K] int64, top_probs [B, L, K] float32."""
        h = self.hidden_size
        columns = np.concatenate([np.arange(self.layers.index(layer) * h, (self.layers.index(layer) + 1) * h)
                                  for layer in layers])
        tokens, valid = padded_tokens(self.data, idx)
        b, length = tokens.shape
        features = np.zeros((b, length, len(columns)), np.float32)
        top_ids = np.zeros((b, length, TOP_K), np.int64)
        top_probs = np.zeros((b, length, TOP_K), np.float32)
        for r, i in enumerate(idx):
            a, e = int(self.data.offsets[i]), int(self.data.offsets[i + 1])
            features[r, :e - a] = self.features[a:e][:, columns]
            top_ids[r, :e - a], top_probs[r, :e - a] = self.top_ids[a:e], self.top_probs[a:e]
        return (tokens.to(device), torch.from_numpy(features).to(device=device, dtype=dtype), valid.to(device),
                torch.from_numpy(top_ids).to(device), torch.from_numpy(top_probs).to(device))


def target_identity(target) -> dict:
    """What a feature folder records of the target that made it: its shape, dtype and how its weights multiply."""
    from .cost_tables import table_key

    key = table_key(target)
    return json.loads(json.dumps({k: key[k] for k in ("config", "dtype", "weights")}, default=str))


def padded_tokens(data: DraftData, idx: list):
    """Sequences idx padded (0) to the longest: tokens [B, L] int64 and valid [B, L] bool."""
    width = max(int(data.offsets[i + 1] - data.offsets[i]) for i in idx)
    tokens = torch.zeros(len(idx), width, dtype=torch.long)
    valid = torch.zeros(len(idx), width, dtype=torch.bool)
    for r, i in enumerate(idx):
        seq = data.sequence(i)
        tokens[r, :len(seq)], valid[r, :len(seq)] = seq.long(), True
    return tokens, valid


def draft_vocabulary(data: DraftData, size: int, vocab_size: int | None = None, split: str = "train") -> torch.Tensor:
    """The `size` most frequent tokens of the split's sequences (sorted ids): what the heads score. When the data
    hold fewer distinct tokens, the lowest ids not in them fill the rest (a BPE vocabulary numbers its tokens in
    merge order, roughly by frequency in the tokenizer's corpus): a head can propose tokens its data never showed."""
    counts = token_counts(data, split, vocab_size)
    seen = int((counts > 0).sum())
    if vocab_size is None or size <= seen:
        return counts.topk(min(size, seen)).indices.sort().values
    unseen = (counts == 0).nonzero().flatten()[: size - seen]
    return torch.cat(((counts > 0).nonzero().flatten(), unseen)).sort().values


def token_counts(data: DraftData, split: str, vocab_size: int | None, answers_only: bool = False) -> torch.Tensor:
    pieces = []
    for i in data.indices(split):
        seq = data.sequence(i)
        pieces.append(seq[int(data.answer_start[i]):] if answers_only else seq)
    return torch.bincount(torch.cat(pieces).long(), minlength=vocab_size or 1)


def vocabulary_coverage(data: DraftData, sizes, vocab_size: int) -> dict:
    """{size: the share of the validation answers' tokens inside draft_vocabulary(data, size)}."""
    counts = token_counts(data, "validation", vocab_size, answers_only=True).double()
    return {size: float(counts[draft_vocabulary(data, size, vocab_size)].sum() / counts.sum()) for size in sizes}


def batches(indices: list, lengths: list, tokens_per_batch: int, generator: torch.Generator):
    """Shuffled batches of whole sequences, about tokens_per_batch tokens each (padded to the longest)."""
    order = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
    batch, width = [], 0
    for i in order:
        width = max(width, lengths[i])
        batch.append(i)
        if width * len(batch) >= tokens_per_batch:
            yield batch
            batch, width = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------------------- EAGLE


def ttt_forward(head: EagleHead, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list:
    """EAGLE-3's training-time test, differentiable: logits [B, L - 1, Vd] per step s < steps. Row p of step s is
    what drafting computes at its (s+1)-th step from a round whose target-fed pairs end at p - s: its pair (the
    head's step s-1 output at row p-1, or the target's feature p at s = 0; token p+1) sits at position p and
    attends to the target-fed pairs at positions <= p - s and to its own draft-step pairs at p - s + 1 .. p. Its
    label is the target's distribution after token p + 1. Rows p < s have no round and are not scored."""
    layer, config = head.decoder.layers[0], head.decoder.config
    b, length = tokens.shape
    n, hq, hkv, eps = length - 1, config.num_attention_heads, config.num_key_value_heads, config.rms_norm_eps
    angles = torch.arange(n, device=tokens.device).float().unsqueeze(-1) * head.decoder.inv_freq
    angles = torch.cat((angles, angles), -1)[None, :, None]  # [1, n, 1, D]
    cos, sin = angles.cos().to(features.dtype), angles.sin().to(features.dtype)
    p = torch.arange(n, device=tokens.device)
    feature, keys, values, out = features[:, :-1], [], [], []
    for s in range(steps):
        x = head.inputs(tokens[:, 1:], feature)  # [B, n, H]
        q, k, v = rotary_split(linear(rms_norm(x, layer.input_layernorm, eps), layer.qkv_proj, layer.qkv_bias),
                               cos, sin, hq, hkv, False)
        keys.append(k)
        values.append(v)
        # Keys: step 0's at every position, then step r's; query p sees step 0 at j <= p - s, step r at p - s + r.
        allowed = [p[None, :] <= (p - s)[:, None]] + [p[None, :] == (p - s + r)[:, None] for r in range(1, s + 1)]
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
                                              torch.cat(values, 1).transpose(1, 2), attn_mask=torch.cat(allowed, 1),
                                              enable_gqa=True).transpose(1, 2)
        x = x + linear(attn.reshape(b, n, -1), layer.o_proj)
        x = x + linear(silu_mul(linear(rms_norm(x, layer.post_attention_layernorm, eps), layer.gate_up_proj), False),
                       layer.down_proj)
        logits = linear(rms_norm(x, head.decoder.norm, eps), head.decoder.embed_tokens)
        out.append(logits.to(torch.promote_types(logits.dtype, torch.float32)))  # float32, or float64 (tests)
        feature = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), 1)  # row p's next input: this step's row p-1
    return out


def target_distribution(top_ids, top_probs, remap: torch.Tensor):
    """The target's top-k over the draft vocabulary, renormalised: (draft indices [.., K] (0 outside), probabilities
    [.., K] (0 outside), a row holds mass [..] bool)."""
    index = remap[top_ids]
    probs = torch.where(index >= 0, top_probs, 0.0)
    mass = probs.sum(-1, keepdim=True)
    return index.clamp(min=0), probs / mass.clamp(min=1e-6), mass[..., 0] > 0


def eagle3_loss(head, tokens, features, valid, top_ids, top_probs, remap, unroll: int):
    """Sum over steps of 0.8^s x the cross-entropy at step s (ttt_forward), over its scored rows. Returns (loss,
    per-step losses)."""
    steps = min(unroll, tokens.shape[1] - 1)
    # Row p's label: the target's distribution after token p + 1, stored at p + 1.
    index, probs, has_mass = target_distribution(top_ids[:, 1:], top_probs[:, 1:], remap)
    p = torch.arange(tokens.shape[1] - 1, device=tokens.device)
    losses = []
    for s, logits in enumerate(ttt_forward(head, tokens, features, steps)):
        rows = valid[:, 1:] & has_mass & (p >= s)
        ce = -(probs * logits.log_softmax(-1).gather(-1, index)).sum(-1)
        losses.append((ce * rows).sum() / rows.sum().clamp(min=1))
    if not losses:  # one-token sequences only: nothing to score (a zero that still has a graph)
        return sum(p.sum() * 0.0 for p in head.fc.parameters()), losses
    return sum(0.8 ** s * loss for s, loss in enumerate(losses)), losses


def eagle_loss(head: EagleHead, tokens, features, valid, noise: float, generator: torch.Generator):
    """EAGLE-1: pairs j = (feature j, token j+1) for j < L - 1: the head predicts feature j+1 and the target's
    distribution after token j+1 (from that feature through the final norm and the restricted LM head). The
    regression is on the features through the target's final norm, what the LM head sees: the raw ones' scale
    means nothing to it."""
    norm, eps = head.decoder.norm, head.target_config.rms_norm_eps
    with torch.no_grad():
        normed = rms_norm(features, norm, eps)
        p = linear(normed, head.decoder.embed_tokens).float().softmax(-1)
    logits, predicted = head.decoder(None, None, inputs_embeds=head.inputs(tokens[:, 1:], features[:, :-1], noise,
                                                                           generator), output_hidden_states=True)
    mask = valid[:, 1:]
    n = mask.sum().clamp(min=1)
    regression = (F.smooth_l1_loss(rms_norm(predicted, norm, eps), normed[:, 1:], reduction="none").mean(-1)
                  * mask).sum() / n
    ce = -((p[:, 1:] * logits.log_softmax(-1)).sum(-1) * mask).sum() / n
    return regression, ce


def medusa_loss(heads: MedusaHeads, tokens, features, valid, remap: torch.Tensor):
    """Head i at token j: cross-entropy against token j + 2 + i (hard labels: the target's text), when that token
    is inside the sequence and the draft vocabulary; weights 0.8^i."""
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


@torch.no_grad()
def chain_acceptance(head: EagleHead, features: TargetFeatures, indices: list, k: int, device,
                     tokens_per_batch: int = 4096) -> float:
    """The mean acceptance length greedy chain drafting of k tokens has on the greedy answers `indices` (their
    prompts decoded to their length), computed teacher-forced: ttt_forward is drafting exactly, so a round after
    token p + 1 accepts the leading steps s whose draft (the argmax of step s at row p + s) is the target's greedy
    token there. The rounds are the decoder's: the first after the prompt's last token, each next after the last
    token the one before emitted, k capped by the tokens left (GenerationStats.mean_acceptance_length)."""
    data = features.data
    lengths = data.lengths
    accepted = rounds = 0
    for idx in batches(indices, lengths, tokens_per_batch, torch.Generator().manual_seed(0)):
        tokens, feats, valid, top_ids, _ = features.batch(idx, head.feature_layers or features.layers[-1:], device,
                                                          head.fc.weight.dtype)
        n = tokens.shape[1] - 1
        greedy = top_ids[:, 1:, 0]  # [B, n]: the target's token after row p's token p + 1
        hits = [head.draft_vocab[logits.argmax(-1)] == greedy for logits in ttt_forward(head, tokens, feats, k)]
        run = torch.zeros(len(idx), n, dtype=torch.long)  # [B, n]: accepted drafts of a round at row p
        alive = torch.ones(len(idx), n, dtype=torch.bool)
        for s, hit in enumerate(hits[:n]):  # step s drafts at row p + s
            alive[:, :n - s] &= hit[:, s:].cpu()
            alive[:, n - s:] = False
            run += alive
        for r, i in enumerate(idx):
            length, p = lengths[i], int(data.answer_start[i]) - 2
            while length - (p + 2) > 0:  # tokens p + 2 .. length - 1 left to emit
                if p < 0:  # a one-token prompt: no feature yet, so its first round drafts nothing
                    p += 1
                    continue
                asked = min(k, length - (p + 2) - 1)
                taken = min(int(run[r, p]), asked) if asked else 0
                accepted, rounds = accepted + taken, rounds + (asked > 0)
                p += taken + 1
    return 1.0 + accepted / rounds if rounds else 1.0


def draft_remap(draft_vocab: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    """[V] int64: a target token's index in the draft vocabulary, -1 outside it."""
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[draft_vocab.cpu()] = torch.arange(len(draft_vocab))
    return remap.to(device)


def step_loss(kind: str, head, feature_layers, tokens, features, valid, top_ids, top_probs, remap, unroll: int,
              noise: float, ce_weight: float, generator: torch.Generator):
    """One batch's loss for `kind` (EAGLE-3 with feature_layers, EAGLE-1, Medusa) and its log entry."""
    if kind == "eagle" and feature_layers:
        loss, per_step = eagle3_loss(head, tokens, features, valid, top_ids, top_probs, remap, unroll)
        return loss, {"loss": loss.item(), **{f"step{s}": v.item() for s, v in enumerate(per_step)}}
    if kind == "eagle":
        regression, ce = eagle_loss(head, tokens, features, valid, noise, generator)
        loss = regression + ce_weight * ce
        return loss, {"loss": loss.item(), "regression": regression.item(), "ce": ce.item()}
    loss = medusa_loss(head, tokens, features, valid, remap)
    return loss, {"loss": loss.item()}


def eagle_parameters(head: EagleHead) -> list:
    """What training changes: fc, the input norm and the decoder layer; with feature_layers also fuse, its norms
    and the final norm. Never the target's embedding or LM-head rows."""
    params = [head.fc.weight, head.fc.bias, head.feature_norm] + list(head.decoder.layers[0].parameters())
    return params + ([head.fuse.weight, head.fuse_norms, head.decoder.norm] if head.feature_layers else [])


def train(kind: str, target, features: TargetFeatures, draft_vocab: torch.Tensor, *, out_dir, epochs: int = 4,
          lr: float = 1e-3, tokens_per_batch: int = 2048, noise: float = 0.1, ce_weight: float = 0.1,
          unroll: int = 3, feature_layers: tuple | None = None, num_heads: int = 4, seed: int = 0,
          checkpoint_every: int = 50, save_dtype: torch.dtype | None = None, autocast: torch.dtype | None = None,
          resume: bool = False, stop_after: int | None = None, on_epoch=None, progress: bool = True):
    """Trains an EAGLE head (EAGLE-3 with feature_layers, else EAGLE-1) or Medusa heads on the features' "train"
    split; writes out_dir/{kind}.safetensors (weights in save_dtype, default the target's), a checkpoint,
    {kind}_loss.png and {kind}_log.json (with each epoch's validation chain acceptance for EAGLE-3). autocast: the
    matrix products' dtype in the forward and backward passes (torch.autocast; bfloat16 runs 1.9x faster on a CPU
    with AVX512-BF16), the weights and optimiser state staying in the target's dtype. resume: continue
    from the checkpoint (without it, an existing checkpoint is an error). stop_after: stop after that many steps
    (an interruption, for tests). on_epoch(epoch, head, entry): called after each epoch. Returns the head."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = out_dir / f"{kind}_checkpoint.pt"
    if checkpoint.exists() and not resume:
        raise ValueError(f"{checkpoint} exists: resume it (--resume) or train into another folder")
    device, dtype = target.device, target.dtype
    g = torch.Generator().manual_seed(seed)
    if kind == "eagle":
        head = EagleHead(target, draft_vocab, feature_layers).init_weights(g)
        params = eagle_parameters(head)
        layers = feature_layers or (target.config.num_hidden_layers - 1,)
    elif kind == "medusa":
        head = MedusaHeads(target, draft_vocab, num_heads)
        params = [head.weight, head.bias]  # zeros: every head starts as the target's own LM head
        layers = (target.config.num_hidden_layers - 1,)
    else:
        raise ValueError(f"train: kind must be 'eagle' or 'medusa', got {kind!r}")
    for p in params:
        p.requires_grad_(True)
    optimiser = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    data = features.data
    lengths = data.lengths
    train_idx, validation_idx = data.indices("train"), data.indices("validation", greedy_only=True)
    if not train_idx:
        raise ValueError("train: the data hold no training sequences")
    # Every epoch's batches, a function of (seed, epoch): a resumed run sees the same ones (their count varies).
    orders = [list(batches(train_idx, lengths, tokens_per_batch, torch.Generator().manual_seed(seed * 1000 + epoch)))
              for epoch in range(epochs)]
    first_step = [sum(len(o) for o in orders[:epoch]) for epoch in range(epochs + 1)]
    total_steps = first_step[-1]
    settings = {"kind": kind, "feature_layers": list(feature_layers or ()), "epochs": epochs, "lr": lr, "seed": seed,
                "tokens_per_batch": tokens_per_batch, "unroll": unroll, "num_heads": num_heads, "noise": noise,
                "autocast": str(autocast), "draft_vocab": draft_vocab.tolist(), "sequences": len(data)}
    warmup = min(50, max(1, total_steps // 20))  # linear warm-up, then a cosine to 0
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    step, log, epochs_log = 0, [], []
    if resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        changed = sorted(k for k in settings if state.get("settings", {}).get(k) != settings[k])
        if changed or len(state["params"]) != len(params):
            raise ValueError(f"{checkpoint}: made with other settings ({', '.join(changed) or 'parameters'}); resume "
                             f"with the same ones or train into another folder")
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        optimiser.load_state_dict(state["optimiser"])
        schedule.load_state_dict(state["schedule"])
        step, log, epochs_log = state["step"], state["log"], state["epochs"]
    remap = draft_remap(draft_vocab, target.config.vocab_size, device)

    def save_checkpoint():
        torch.save({"params": [p.detach().clone() for p in params], "optimiser": optimiser.state_dict(),
                    "schedule": schedule.state_dict(), "step": step, "log": log, "epochs": epochs_log,
                    "settings": settings}, checkpoint)

    start = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc=f"training {kind}", disable=not progress)
    for epoch in range(epochs):
        if step >= first_step[epoch + 1]:
            continue
        for idx in orders[epoch][step - first_step[epoch]:]:
            if stop_after is not None and step >= stop_after:
                save_checkpoint()
                bar.close()
                return head
            tokens, feats, valid, top_ids, top_probs = features.batch(idx, layers, device, dtype)
            noise_generator = torch.Generator().manual_seed(seed * 1_000_003 + step)  # resumable
            with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss, entry = step_loss(kind, head, feature_layers, tokens, feats, valid, top_ids, top_probs, remap,
                                        unroll, noise, ce_weight, noise_generator)
            entry = {"step": step, **entry}
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            schedule.step()
            log.append(entry)
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{entry['loss']:.3f}")
            if step % checkpoint_every == 0:
                save_checkpoint()
        summary = {"epoch": epoch + 1, "step": step, "seconds": round(time.perf_counter() - start)}
        if kind == "eagle" and feature_layers and validation_idx:
            summary["validation_chain_acceptance"] = chain_acceptance(head, features, validation_idx, unroll, device)
        epochs_log.append(summary)
        save_checkpoint()
        if on_epoch is not None:
            on_epoch(epoch + 1, head, summary)
    bar.close()
    for p in params:
        p.requires_grad_(False)
    head.save(out_dir / f"{kind}.safetensors", save_dtype)
    (out_dir / f"{kind}_log.json").write_text(json.dumps({
        "kind": kind, "feature_layers": list(feature_layers or ()), "steps": step, "tokens": len(data.tokens),
        "seconds": time.perf_counter() - start, "epochs": epochs_log, "log": log}))
    plot_losses(log, out_dir / f"{kind}_loss.png", kind)
    return head


def plot_losses(log: list, path, kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    keys = [k for k in log[0] if k != "step"] if log else []
    for key in keys:
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

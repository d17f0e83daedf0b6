"""Draft heads trained on a target model's own hidden states (its last layer's output, before the final norm).

EagleHead (EAGLE, Li et al. 2024): fc(concat(embedding of token j+1, RMSNorm(feature of token j))) -> one Llama
decoder layer with its own KV cache -> the target's final norm -> the target's LM head restricted to a draft
vocabulary. Its output at pair j is its estimate of the feature of token j+1, so later draft steps feed their own
outputs. The input norm (learned, as EAGLE-3's) makes the head blind to the features' scale, as the final norm
is: a small model's residual stream runs to RMS 30 with single dimensions in the hundreds, which would swamp the
token embedding in fc.

With feature_layers (EAGLE-3, Li et al. 2025) the head reads the target's low, middle and high layers instead of
its last: each layer's output RMS-normed (its own learned weight), the three side by side projected to one feature
(fuse, 3H -> H), which then enters as the last layer's feature does above. Its outputs are trained only to predict
tokens (no regression onto the target's features: they live in the head's own space, fed back at later draft
steps), so its final norm is its own, trained; the LM-head rows stay the target's.

MedusaHeads (Medusa, Cai et al. 2024): head i = ResBlock (z + SiLU(W_i z + b_i)) on the normed feature z of the
last scored token -> the same restricted LM head, predicting the token i + 1 places after the one that feature
predicts.

Both score only the draft vocabulary (a sorted list of token ids, the frequent ones): q is zero elsewhere, which
keeps speculative sampling lossless (a target token outside it comes through the residual) and makes a draft step
cheap next to the target's full LM head. The target's embedding, final norm and LM head are shared, never copied
into a head's file: a file holds the trained weights, the draft vocabulary and the target's shape it was made for.
"""
import dataclasses
import json

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .llama import LlamaForCausalLM, embed, linear, rms_norm
from .quantized import QuantizedWeight, quantize_q8_0


def check_draft_vocab(draft_vocab: torch.Tensor, vocab_size: int, what: str) -> torch.Tensor:
    if not isinstance(draft_vocab, torch.Tensor) or draft_vocab.dim() != 1 or draft_vocab.numel() == 0 or \
            draft_vocab.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: draft_vocab must be a non-empty 1-D integer tensor of token ids")
    ids = draft_vocab.long().cpu()
    if not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"{what}: draft_vocab must be sorted, distinct token ids in [0, {vocab_size})")
    return ids


def eagle3_layers(num_layers: int) -> tuple:
    """EAGLE-3's low, middle and high layers (outputs of layers 2, L/2 and L-3, 0-based), distinct and sorted."""
    if num_layers < 2:
        raise ValueError(f"EAGLE-3 features need a target of at least 2 layers, got {num_layers}")
    chosen = {min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}
    if len(chosen) < min(3, num_layers):  # a shallow target (4 or 5 layers): its first, middle and last
        chosen = {0, (num_layers - 1) // 2, num_layers - 1}
    return tuple(sorted(chosen))


class EagleHead(nn.Module):
    def __init__(self, target: LlamaForCausalLM, draft_vocab: torch.Tensor, feature_layers: tuple | None = None):
        super().__init__()
        c = target.config
        self.draft_vocab = check_draft_vocab(draft_vocab, c.vocab_size, "EagleHead").to(target.device)
        if feature_layers is not None:
            problem = f"EagleHead: feature_layers must be at least 2 distinct layer indices in [0, " \
                      f"{c.num_hidden_layers}), got {feature_layers!r}"
            if not isinstance(feature_layers, (list, tuple)) or len(feature_layers) < 2:
                raise ValueError(problem)
            feature_layers = tuple(feature_layers)
            try:
                target.check_capture(feature_layers)  # distinct indices of the target's layers
            except ValueError:
                raise ValueError(problem) from None
        self.feature_layers = feature_layers
        n = len(feature_layers or ())
        # One decoder layer whose tied "embedding" is the restricted LM head: its forward runs on inputs_embeds.
        layer_config = dataclasses.replace(c, num_hidden_layers=1, vocab_size=len(self.draft_vocab),
                                           tie_word_embeddings=True)
        self.decoder = LlamaForCausalLM(layer_config, dtype=target.dtype, device=target.device, ops=target.ops)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True, dtype=target.dtype, device=target.device)
        self.feature_norm = nn.Parameter(torch.ones(c.hidden_size, dtype=target.dtype, device=target.device))
        if n:
            self.fuse_norms = nn.Parameter(torch.ones(n, c.hidden_size, dtype=target.dtype, device=target.device))
            self.fuse = nn.Linear(n * c.hidden_size, c.hidden_size, bias=False, dtype=target.dtype,
                                  device=target.device)
        self.target_config = c
        self.fc_blocks = self.fuse_blocks = None  # fc's and fuse's weights as Q8_0 blocks (on_integer_kernels)
        self.share_target_weights(target)

    @property
    def feature_width(self) -> int:
        """The width of the target features the head takes: H, or len(feature_layers) x H."""
        return self.target_config.hidden_size * len(self.feature_layers or (None,))

    @property
    def on_integer_kernels(self) -> bool:
        return self.fc_blocks is not None

    def use_integer_kernels(self, target: LlamaForCausalLM) -> "EagleHead":
        """The head on the target's integer kernels, for a target that keeps its LM head as GGUF blocks with 8-bit
        activations: the restricted LM head becomes those rows' own blocks (no float copy: 16,384 rows of the
        shipped model read 10 MB a step instead of 38), fc and the decoder layer's projections Q8_0
        (quantize_q8_0), all multiplied as the target's are. For decoding only: a head in this form is not trained
        or saved. Returns self."""
        if not isinstance(target.lm_head, QuantizedWeight) or target.activations != "int8":
            raise ValueError("EagleHead.use_integer_kernels: the target must keep its LM head as GGUF blocks with "
                             "activations='int8'")
        check_target(self.target_config, target, "EagleHead")
        rows = target.lm_head.gather(self.draft_vocab)
        self.decoder._parameters.pop("embed_tokens", None)
        self.decoder._parameters.pop("lm_head", None)
        self.decoder.embed_tokens = self.decoder.lm_head = rows
        layer = self.decoder.layers[0]
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weight = layer._parameters.pop(name)
            setattr(layer, name, quantize_q8_0(weight, "int8"))
        self.fc_blocks = quantize_q8_0(self.fc.weight, "int8")
        if self.feature_layers:
            self.fuse_blocks = quantize_q8_0(self.fuse.weight, "int8")
        return self

    def share_target_weights(self, target: LlamaForCausalLM) -> None:
        """The target's embedding (for token j+1), final norm and restricted LM head: views, frozen."""
        check_target(self.target_config, target, "EagleHead")
        self.embed = target.embed_tokens.detach()  # not one of the head's parameters (a tensor, or GGUF blocks)
        with torch.no_grad():
            self.decoder.norm.copy_(target.norm)
            self.decoder.embed_tokens.copy_(target.lm_head[self.draft_vocab])
        self.decoder.norm.requires_grad_(self.feature_layers is not None)  # EAGLE-3: its own final norm
        self.decoder.embed_tokens.requires_grad_(False)

    def init_weights(self, generator: torch.Generator | None = None) -> "EagleHead":
        """Random weights (std 1/sqrt(fan-in), norms 1): the start of training, and the heads of tests."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith("decoder.") and "layers." not in name:
                    continue  # the target's norm (EAGLE-3's final norm starts as it) and LM head rows
                if "norm" in name:
                    p.fill_(1.0)
                elif p.dim() == 1:
                    p.fill_(0.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
        return self

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """[..., len(feature_layers) x H] target features -> [..., H]: each layer's RMS-normed, then fuse."""
        h, eps = self.target_config.hidden_size, self.target_config.rms_norm_eps
        parts = [rms_norm(features[..., i * h:(i + 1) * h], self.fuse_norms[i], eps)
                 for i in range(len(self.feature_layers))]
        return linear(torch.cat(parts, -1), self.fuse.weight if self.fuse_blocks is None else self.fuse_blocks)

    def inputs(self, next_tokens: torch.Tensor, features: torch.Tensor, noise: float = 0.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """[B, P] tokens j+1 and [B, P, H] features of tokens j -> the decoder layer's input [B, P, H]. noise:
        training's uniform noise in [-noise, noise] on the normed features (the head then tolerates the inexact
        features it feeds itself at later draft steps). With feature_layers, features of the width
        len(feature_layers) x H are the target's (fused first); of width H, the head's own outputs."""
        if self.feature_layers and features.shape[-1] == self.feature_width:
            features = self.fuse_features(features)
        normed = rms_norm(features, self.feature_norm, self.target_config.rms_norm_eps)
        if noise:
            normed = normed + (torch.rand(normed.shape, generator=generator).to(normed) - 0.5) * (2 * noise)
        return linear(torch.cat((embed(next_tokens, self.embed), normed), dim=-1),
                      self.fc.weight if self.fc_blocks is None else self.fc_blocks, self.fc.bias)

    def forward(self, next_tokens, features, kv_cache, *, cache_rows=slice(None), logits_indices=None, tree_mask=None):
        """Returns (logits over the draft vocabulary [B, P or n, Vd] float32, predicted features [B, P, H]).
        tree_mask [B, P, P]: the P pairs are a tree (a draft tree's nodes, each seeing its ancestors)."""
        return self.decoder(None, kv_cache, inputs_embeds=self.inputs(next_tokens, features), cache_rows=cache_rows,
                            logits_indices=logits_indices, output_hidden_states=True, tree_mask=tree_mask)

    def trained_state(self) -> dict:
        """The weights a file holds: fc and the decoder layer (not the target's shared tensors)."""
        state = {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        state["feature_norm"] = self.feature_norm
        if self.feature_layers:
            state.update({"fuse.weight": self.fuse.weight, "fuse_norms": self.fuse_norms, "norm": self.decoder.norm})
        layer = self.decoder.layers[0]
        for name in ("input_layernorm", "qkv_proj", "qkv_bias", "o_proj", "post_attention_layernorm", "gate_up_proj",
                     "down_proj"):
            if getattr(layer, name) is not None:
                state[f"layer.{name}"] = getattr(layer, name)
        return state

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """dtype: the weights' dtype in the file (default: as they are); load casts them to the target's."""
        if self.on_integer_kernels:
            raise ValueError("EagleHead.save: a head on the integer kernels holds Q8_0 copies; save the float head")
        extra = {"feature_layers": ",".join(map(str, self.feature_layers))} if self.feature_layers else {}
        save_head(path, "eagle", self.trained_state(), self.draft_vocab, self.target_config, extra, dtype)

    @classmethod
    def load(cls, path, target: LlamaForCausalLM) -> "EagleHead":
        """The head in `path` for `target`; on the target's integer kernels (use_integer_kernels) when the target
        keeps its LM head as GGUF blocks with 8-bit activations."""
        tensors, meta = load_head(path, "eagle", target)
        layers = meta.get("feature_layers")
        if layers is not None and not all(part.isdigit() for part in layers.split(",")):
            raise ValueError(f"{path}: metadata feature_layers must be comma-separated layer indices, got {layers!r}")
        head = cls(target, tensors.pop("draft_vocab"), tuple(map(int, layers.split(","))) if layers else None)
        copy_trained_state(path, head.trained_state(), tensors)
        if isinstance(target.lm_head, QuantizedWeight) and target.activations == "int8":
            head.use_integer_kernels(target)
        return head


class MedusaHeads(nn.Module):
    def __init__(self, target: LlamaForCausalLM, draft_vocab: torch.Tensor, num_heads: int):
        super().__init__()
        c = target.config
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or not 1 <= num_heads <= 16:
            raise ValueError(f"MedusaHeads: num_heads must be an int in [1, 16], got {num_heads!r}")
        self.draft_vocab = check_draft_vocab(draft_vocab, c.vocab_size, "MedusaHeads").to(target.device)
        h = c.hidden_size
        self.weight = nn.Parameter(torch.zeros(num_heads, h, h, dtype=target.dtype, device=target.device))
        self.bias = nn.Parameter(torch.zeros(num_heads, h, dtype=target.dtype, device=target.device))
        self.target_config = c
        self.share_target_weights(target)

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def share_target_weights(self, target: LlamaForCausalLM) -> None:
        """The target's final norm and its LM head's draft-vocabulary rows: a float copy, frozen, and for a target
        that keeps its LM head as GGUF blocks with 8-bit activations also those rows' blocks, which decoding
        multiplies with (the integer kernels; training, with gradients, the copy)."""
        check_target(self.target_config, target, "MedusaHeads")
        self.norm, self.eps = target.norm.detach(), target.config.rms_norm_eps
        self.lm_head = target.lm_head[self.draft_vocab].detach()  # [Vd, H]: a copy of the rows, frozen (training)
        self.lm_head_blocks = target.lm_head.gather(self.draft_vocab) \
            if isinstance(target.lm_head, QuantizedWeight) and target.activations == "int8" else None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, H] (the target's, of the last scored token) -> logits [B, num_heads, Vd] float32: head i
        for the token i + 1 places after the one those features predict."""
        z = rms_norm(features, self.norm, self.eps).unsqueeze(1)  # [B, 1, H]
        h = z + F.silu(torch.einsum("bxh,koh->bko", z, self.weight) + self.bias)
        decoding = self.lm_head_blocks is not None and not torch.is_grad_enabled()
        return linear(h, self.lm_head_blocks if decoding else self.lm_head).float()

    def trained_state(self) -> dict:
        return {"weight": self.weight, "bias": self.bias}

    def save(self, path, dtype: torch.dtype | None = None) -> None:
        """dtype: the weights' dtype in the file (default: as they are); load casts them to the target's."""
        save_head(path, "medusa", self.trained_state(), self.draft_vocab, self.target_config,
                  {"num_heads": self.num_heads}, dtype)

    @classmethod
    def load(cls, path, target: LlamaForCausalLM) -> "MedusaHeads":
        tensors, meta = load_head(path, "medusa", target)
        num_heads = meta.get("num_heads", "")
        if not num_heads.isdigit() or not 1 <= int(num_heads) <= 16:
            raise ValueError(f"{path}: metadata num_heads must be an integer in [1, 16], got {num_heads!r}")
        heads = cls(target, tensors.pop("draft_vocab"), int(num_heads))
        copy_trained_state(path, heads.trained_state(), tensors)
        return heads


# -------------------------------------------------------------------------------------------------- files

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim")


def check_target(made_for: LlamaConfig, target: LlamaForCausalLM, what: str) -> None:
    have = target.config
    wrong = [f"{k} {getattr(made_for, k)} (the target has {getattr(have, k)})" for k in SHAPE_KEYS
             if getattr(made_for, k) != getattr(have, k)]
    if wrong:
        raise ValueError(f"{what}: made for another model: " + ", ".join(wrong))


def save_head(path, kind: str, state: dict, draft_vocab: torch.Tensor, config: LlamaConfig, extra: dict,
              dtype: torch.dtype | None = None) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in state.items()}
    tensors["draft_vocab"] = draft_vocab.cpu().to(torch.int64)
    meta = {"kind": kind, "target": json.dumps({k: getattr(config, k) for k in SHAPE_KEYS}),
            **{k: str(v) for k, v in extra.items()}}
    save_file(tensors, str(path), metadata=meta)


def load_head(path, kind: str, target: LlamaForCausalLM):
    """The file's tensors and metadata, its kind, target shape and draft vocabulary checked."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file: {error}") from error
    if meta.get("kind") != kind:
        raise ValueError(f"{path}: a {meta.get('kind', 'unknown')!r} head file, expected {kind!r}")
    try:
        made_for = json.loads(meta.get("target", ""))
    except ValueError:
        made_for = None
    if not isinstance(made_for, dict):
        raise ValueError(f"{path}: metadata target must be a JSON object of the target's shape, got "
                         f"{meta.get('target')!r}")
    wrong = [f"{k} {made_for.get(k)} (the target has {getattr(target.config, k)})" for k in SHAPE_KEYS
             if made_for.get(k) != getattr(target.config, k)]
    if wrong:
        raise ValueError(f"{path}: draft head made for another model: " + ", ".join(wrong))
    if "draft_vocab" not in tensors:
        raise ValueError(f"{path}: no draft_vocab tensor")
    check_draft_vocab(tensors["draft_vocab"], target.config.vocab_size, str(path))
    return tensors, meta


def copy_trained_state(path, state: dict, tensors: dict) -> None:
    """Copies the file's tensors into a fresh head's trained weights (state), once the file is known to hold
    exactly those, in their shapes: nothing is left as the fresh head's uninitialised memory."""
    missing, extra = sorted(state.keys() - tensors.keys()), sorted(tensors.keys() - state.keys())
    if missing or extra:
        raise ValueError(f"{path}: " + "; ".join(f"{what} tensors {names}" for what, names in
                                                 (("missing", missing), ("unexpected", extra)) if names))
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(state[name].shape) or not t.is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, the head needs a floating-point "
                             f"{tuple(state[name].shape)}")
    with torch.no_grad():
        for name, t in tensors.items():
            state[name].copy_(t)

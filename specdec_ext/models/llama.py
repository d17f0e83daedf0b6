"""A Llama-family decoder (Llama 2/3.x, SmolLM2, TinyLlama, Mistral without sliding window, Qwen2/2.5) on this
library's ops: the math is torch (F.linear, RMSNorm, RoPE, SwiGLU), attention is verify_attention with the new
K/V appended into the KV cache, so the same forward serves prefill, decode and speculative verification.

Weights are stored fused where one GEMM can serve several projections: q/k/v as one [(Hq + 2 Hkv) D, H]
matrix, gate/up as one [2 I, H] matrix.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops as native_ops
from ..host import upload
from ..ops import LIMITS, is_strict
from .config import LlamaConfig
from .quantized import check_activations, is_quantized

# verify_attention's limit on new tokens per call: longer blocks are chunked
MAX_ATTENTION_QUERIES = LIMITS["max_verify_queries"]
MAX_SKINNY_ROWS = LIMITS["max_skinny_rows"]


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with "linear" or "llama3" scaling as transformers applies it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). A weight kept as GGUF blocks (quantized.py): quantized_linear. On the CPU, up to 16
    rows (decode and verify steps): skinny_linear, which reads the weight once with every core (MKL's sgemv uses
    one). More rows (prefill): weight @ x.T, the orientation MKL runs 2.5-4x faster than F.linear's for few rows
    and never slower up to 64 (bench/RESULTS.md)."""
    if is_quantized(weight):
        return weight.linear(x, bias)
    if x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)  # (training: skinny_linear has no backward)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= MAX_SKINNY_ROWS and weight.dtype in (torch.float32, torch.bfloat16) and \
            rows.dtype == weight.dtype:
        # the op itself: shapes, dtypes and devices are the model's own (ops.skinny_linear checks callers')
        return torch.ops.specdec.skinny_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    y = torch.mm(weight, rows.t()).t().contiguous()  # callers (the sampling kernels) need contiguous rows
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def embed(ids: torch.Tensor, table) -> torch.Tensor:
    """The rows of an embedding table (a tensor, or GGUF blocks dequantised row by row) for token ids."""
    return table[ids] if is_quantized(table) else F.embedding(ids, table)


def fused_glue(x: torch.Tensor, weights=()) -> bool:
    """Whether the CPU's one-call elementwise ops (cpu/model_glue.cpp, no autograd) serve x and these weights:
    float32 or bfloat16 CPU tensors that no gradient flows through (weights is read only with grad enabled)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    return not torch.is_grad_enabled() or not (x.requires_grad or any(w.requires_grad for w in weights))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers computes it: in float32, then scaled by the weight in the input's dtype (on the CPU in one
    call; for float32, torch's rms_norm computes exactly that in one call)."""
    if fused_glue(x, (weight,)) and weight.dtype == x.dtype:
        return torch.ops.specdec.rms_norm(x.contiguous(), weight.contiguous(), eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, Q, H, D] rotated by the angles of its positions (cos/sin [B, Q, 1, D]); halves, not interleaved."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# A layer's elementwise steps: one call each on the CPU (cpu/model_glue.cpp) when `fused`, torch's expressions
# otherwise (CUDA, autograd, other dtypes); the same values either way.

def rotary_split(qkv: torch.Tensor, cos, sin, hq: int, hkv: int, fused: bool):
    """qkv [B, Q, (hq + 2 hkv) D] -> q [B, Q, hq, D] and k rotated, v; all contiguous."""
    if fused:
        return torch.ops.specdec.rotary_split(qkv, cos, sin, hq, hkv)
    b, n, width = qkv.shape
    d = width // (hq + 2 * hkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = apply_rope(q.view(b, n, hq, d), cos, sin).contiguous()
    k = apply_rope(k.view(b, n, hkv, d), cos, sin).contiguous()
    return q, k, v.reshape(b, n, hkv, d).contiguous()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool):
    """The residual stream after adding delta, and its norm: (x + delta, rms_norm(x + delta)). Fused, x (a tensor the
    forward owns) is added into in place."""
    if fused:
        return x, torch.ops.specdec.add_rms_norm(x, delta, weight, eps)
    x = x + delta
    return x, rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    if fused:
        return torch.ops.specdec.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig, *, dtype=torch.float32, device="cpu", ops=None):
        super().__init__()
        self.config = config
        c = config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        def empty(*shape):
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        self.embed_tokens = empty(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            layer = nn.Module()
            layer.input_layernorm = empty(c.hidden_size)
            layer.qkv_proj = empty(q + 2 * kv, c.hidden_size)
            layer.qkv_bias = empty(q + 2 * kv) if c.attention_bias else None
            layer.o_proj = empty(c.hidden_size, q)
            layer.post_attention_layernorm = empty(c.hidden_size)
            layer.gate_up_proj = empty(2 * c.intermediate_size, c.hidden_size)
            layer.down_proj = empty(c.hidden_size, c.intermediate_size)
            self.layers.append(layer)
        self.norm = empty(c.hidden_size)
        self.lm_head = self.embed_tokens if c.tie_word_embeddings else empty(c.vocab_size, c.hidden_size)
        self.register_buffer("inv_freq", rope_inverse_frequencies(c).to(device), persistent=False)
        self.ops = ops or native_ops  # verify_attention from specdec_ext.ops, specdec_ext.sim or specdec_ext.reference

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def quantized_weights(self) -> list:
        """The weights kept as GGUF blocks (QuantizedWeight or QuantizedRowStack), each once."""
        found = []
        for layer in self.layers:
            found += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
        found += [self.embed_tokens] + ([] if self.lm_head is self.embed_tokens else [self.lm_head])
        return [w for w in found if is_quantized(w)]

    @property
    def rows_invariant(self) -> bool:
        """Whether a row's logits have the same bits in any block of rows, whatever the others: every projection
        and the LM head kept as GGUF blocks with 8-bit activations, on the CPU (the integer GEMM and the CPU
        attention; float GEMMs of many rows, MKL's or cuBLAS's, need not be)."""
        projections = [w for layer in self.layers
                       for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)] + [self.lm_head]
        return self.device.type == "cpu" and all(is_quantized(w) and w.activations == "int8" for w in projections)

    @property
    def activations(self) -> str:
        """How the weights kept as GGUF blocks multiply: "float", or "int8" (activations quantised to 8 bits per 32
        values, integer dot products on the CPU: quantized_linear's activations). "float" for a model without
        them."""
        modes = {w.activations for w in self.quantized_weights()}
        return modes.pop() if len(modes) == 1 else "float"

    @activations.setter
    def activations(self, mode: str) -> None:
        check_activations("LlamaForCausalLM", mode)
        kept = self.quantized_weights()
        if mode != "float" and not kept:
            raise ValueError(f"LlamaForCausalLM: activations={mode!r} needs weights kept as GGUF blocks "
                             "(from_pretrained(..., keep_quantized=True))")
        for w in kept:
            w.activations = mode

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def new_kv_cache(self, batch_size: int, max_seq_len: int, *, paged: bool = False, page_size: int = 16,
                     num_pages: int | None = None):
        """A KV cache for this model: StaticKVCache [L, B, max_seq_len, Hkv, D], or a PagedKVCache with room for
        batch_size requests of max_seq_len tokens (num_pages: that many pages, by default)."""
        from ..kv_cache import PagedKVCache, StaticKVCache

        c = self.config
        if paged:
            pages_per_seq = -(-max_seq_len // page_size)
            return PagedKVCache(c.num_hidden_layers, num_pages or batch_size * pages_per_seq, page_size,
                                c.num_key_value_heads, c.head_dim, max_batch_size=batch_size,
                                max_pages_per_seq=pages_per_seq, dtype=self.dtype, device=self.device)
        return StaticKVCache(c.num_hidden_layers, batch_size, max_seq_len, c.num_key_value_heads, c.head_dim,
                             dtype=self.dtype, device=self.device)

    def slot(self, name: str) -> torch.Tensor:
        """The tensor (or the view of a fused one) that the Hugging Face weight `name` is stored in."""
        c = self.config
        q, kv, i = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        if name == "model.embed_tokens.weight":
            return self.embed_tokens
        if name == "model.norm.weight":
            return self.norm
        if name == "lm_head.weight" and not c.tie_word_embeddings:
            return self.lm_head
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) >= 5:
            layer = self.layers[int(parts[2])]
            key = ".".join(parts[3:])
            fused = {"self_attn.q_proj": (0, q), "self_attn.k_proj": (q, q + kv), "self_attn.v_proj": (q + kv,
                                                                                                       q + 2 * kv)}
            module, kind = key.rsplit(".", 1)
            if module in fused:
                lo, hi = fused[module]
                target = layer.qkv_proj if kind == "weight" else layer.qkv_bias
                if target is not None:
                    return target[lo:hi]
            elif kind == "weight":
                simple = {"self_attn.o_proj": layer.o_proj, "input_layernorm": layer.input_layernorm,
                          "post_attention_layernorm": layer.post_attention_layernorm,
                          "mlp.gate_proj": layer.gate_up_proj[:i], "mlp.up_proj": layer.gate_up_proj[i:],
                          "mlp.down_proj": layer.down_proj}
                if module in simple:
                    return simple[module]
        raise ValueError(f"LlamaForCausalLM: unexpected weight {name!r} for a {c.model_type} model")

    def weight_names(self) -> list[str]:
        """The Hugging Face names of every weight this model needs."""
        c = self.config
        names = ["model.embed_tokens.weight",
                 "model.norm.weight"] + ([] if c.tie_word_embeddings else ["lm_head.weight"])
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + n + ".weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                  "self_attn.o_proj", "input_layernorm", "post_attention_layernorm",
                                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
            if c.attention_bias:
                names += [p + n + ".bias" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]
        return names

    def positions(self, cache_seqlens: torch.Tensor, num_queries: int, tree_mask) -> torch.Tensor:
        """[B, Q] positions of the new tokens: after the cache, or at the cache length + depth in a tree."""
        offsets = torch.arange(num_queries, device=cache_seqlens.device)
        if tree_mask is not None:  # a node sees itself and its ancestors: its depth is their count - 1
            offsets = tree_mask.sum(-1) - 1
        return cache_seqlens.long().unsqueeze(-1) + offsets

    def attention(self, q, k, v, kv_cache, layer: int, rows, tree_mask, qo_indptr=None) -> torch.Tensor:
        """Appends k/v at the cache lengths and attends; blocks longer than verify_attention takes are chunked,
        each chunk seeing the cache and the chunks before it. qo_indptr: q, k, v are [1, T, ...], the flat rows
        of the requests (a ragged prefill step; each request's rows within verify_attention's limit)."""
        if kv_cache is None:  # a whole sequence, causal, differentiable (training a draft head)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(1, 2)
        k_cache, v_cache, seqlens, table = kv_cache.attention_args(layer, rows)
        if qo_indptr is not None:
            return self.ops.verify_attention(q[0], k_cache, v_cache, seqlens, k[0], v[0], block_table=table,
                                             qo_indptr=qo_indptr).to(q.dtype)[None]
        n = q.shape[1]
        if n <= MAX_ATTENTION_QUERIES:
            out = self.ops.verify_attention(q, k_cache, v_cache, seqlens, k, v, block_table=table, tree_mask=tree_mask)
            return out.to(q.dtype)
        chunks = []
        for c0 in range(0, n, MAX_ATTENTION_QUERIES):
            c1 = min(n, c0 + MAX_ATTENTION_QUERIES)
            chunks.append(self.ops.verify_attention(q[:, c0:c1].contiguous(), k_cache, v_cache, seqlens + c0,
                                                    k[:, c0:c1].contiguous(), v[:, c0:c1].contiguous(),
                                                    block_table=table).to(q.dtype))
        return torch.cat(chunks, dim=1)

    def check_input(self, input_ids, inputs_embeds, kv_cache, rows: slice, tree_mask, qo_indptr=None) -> None:
        if inputs_embeds is not None:
            if input_ids is not None:
                raise ValueError("LlamaForCausalLM: pass input_ids or inputs_embeds, not both")
            if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or \
                    inputs_embeds.shape[-1] != self.config.hidden_size or inputs_embeds.dtype != self.dtype:
                raise ValueError(f"LlamaForCausalLM: inputs_embeds must be a [B, Q, {self.config.hidden_size}] "
                                 f"{self.dtype} tensor")
            shape = inputs_embeds.shape[:2]
        elif not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                         torch.int32):
            raise ValueError("LlamaForCausalLM: input_ids must be a [B, Q] int64 tensor")
        else:
            shape = input_ids.shape
        rows_in_cache = len(range(*rows.indices(kv_cache.batch_size))) if kv_cache is not None else shape[0]
        if qo_indptr is not None:
            if kv_cache is None or tree_mask is not None or shape[0] != 1:
                raise ValueError("LlamaForCausalLM: qo_indptr (the flat form) takes input_ids [1, T], a KV cache and "
                                 "no tree_mask")
            if not isinstance(qo_indptr, (list, tuple)) or len(qo_indptr) != rows_in_cache + 1 or qo_indptr[0] != 0 \
                    or qo_indptr[-1] != shape[1] or any(not 0 <= e - s <= MAX_ATTENTION_QUERIES
                                                        for s, e in zip(qo_indptr, qo_indptr[1:])):
                raise ValueError(f"LlamaForCausalLM: qo_indptr must be a list of {rows_in_cache + 1} ints from 0 to "
                                 f"{shape[1]}, each request's count in [0, {MAX_ATTENTION_QUERIES}]")
            shape = (rows_in_cache, shape[1])
        if shape[0] != rows_in_cache:
            raise ValueError(f"LlamaForCausalLM: input_ids has {shape[0]} requests, the cache rows {rows_in_cache}")
        if shape[1] == 0:
            raise ValueError("LlamaForCausalLM: input_ids has no tokens")
        if tree_mask is not None and shape[1] > MAX_ATTENTION_QUERIES:
            raise ValueError(f"LlamaForCausalLM: a tree holds at most {MAX_ATTENTION_QUERIES} tokens")
        if input_ids is None:
            return
        # A host read: on CUDA only in strict mode (a decoding round reads the device once, for its results), never
        # inside a CUDA graph (whose ids come from the sampler).
        check = not input_ids.is_cuda or (is_strict() and not torch.cuda.is_current_stream_capturing())
        if check and input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < \
                self.config.vocab_size:
            raise ValueError(f"LlamaForCausalLM: input_ids holds token ids outside [0, {self.config.vocab_size})")

    def forward(self, input_ids, kv_cache, *, tree_mask=None, logits_indices=None, output_hidden_states=False,
                cache_rows: slice = slice(None), inputs_embeds=None, qo_indptr=None, layers: tuple | None = None,
                lm_head=None):
        """input_ids [B, Q]: the new tokens of each request, written into the cache at cache_seqlens[b] + i (at
        positions cache_seqlens[b] + i, or + depth with a tree_mask [Q, Q] / [B, Q, Q] bool). cache_seqlens is not
        advanced: the caller advances or truncates. cache_rows: which requests of the cache the B rows are.
        logits_indices [B, n] (or [n]): the positions to score (default all Q; a prefill needs the last only).
        Returns logits [B, Q or n, V] float32, and with output_hidden_states the last layer's hidden states [B, Q, H]
        (True: before the final norm, as EAGLE-style heads take them) or, given layer indices (l1, l2, ...), the
        residual stream after each of those layers side by side [B, Q, len x H] (EAGLE-3's low, middle and high
        features). inputs_embeds [B, Q, H]
        instead of input_ids: the first layer's input (a draft head's own input projection). kv_cache None: each
        row is a whole sequence from position 0, attended causally by torch (differentiable, for training).
        Token ids outside the vocabulary raise ValueError: checked on the CPU always, on CUDA in strict mode
        (set_strict(True); the check is a host read).
        qo_indptr (a host list of B + 1 ints): the flat form of a ragged batch (prefill): input_ids [1, T] holds
        request b's new tokens at qo_indptr[b] .. qo_indptr[b + 1] (at most verify_attention's limit each, 0 for a
        request of cache_rows that takes none); logits_indices then index the T rows.
        layers: a tuple of increasing layer indices to run, the others skipped (the residual stream passes them
        unchanged), each writing and reading its own layer of the cache; then the final norm and the LM head (a
        self-speculative draft: drafters/self_speculative.py). None: every layer. lm_head: rows of the LM head to
        score instead of the model's own (a draft vocabulary's [Vd, H], or those rows of kept blocks): logits
        [B, Q or n, Vd]."""
        c = self.config
        self.check_input(input_ids, inputs_embeds, kv_cache, cache_rows, tree_mask, qo_indptr)
        cache_layers = self.check_layers(layers, output_hidden_states)
        x = embed(input_ids, self.embed_tokens) if inputs_embeds is None else inputs_embeds
        b, n = x.shape[:2]
        seqlens = kv_cache.attention_args(0, cache_rows)[2] if kv_cache is not None else \
            torch.zeros(b, dtype=torch.int32, device=x.device)
        if qo_indptr is None:
            pos = self.positions(seqlens, n, tree_mask)
        else:  # token t of request r sits at seqlens[r] + (t - qo_indptr[r])
            counts = [e - s for s, e in zip(qo_indptr, qo_indptr[1:])]
            owner = upload([r for r, count in enumerate(counts) for _ in range(count)], torch.long, x.device)
            offset = upload([t for count in counts for t in range(count)], torch.long, x.device)
            pos = (seqlens.long()[owner] + offset).unsqueeze(0)
            qo_indptr = upload(qo_indptr, torch.int32, x.device)
        angles = pos.unsqueeze(-1).float() * self.inv_freq  # [B, Q, D/2], float32 as transformers computes them
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        fused = fused_glue(x, self.parameters())
        if fused:
            x = x.clone(memory_format=torch.contiguous_format)  # the residual stream, added into in place
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps, layers = c.rms_norm_eps, [self.layers[i] for i in cache_layers]
        capture = self.check_capture(output_hidden_states)
        captured = x.new_empty(b, n, len(capture) * c.hidden_size) if capture else None  # [B, Q, len x H]
        step = self.cpu_step_args(x, kv_cache, cache_rows, n, qo_indptr, layers) if fused else None
        if step is not None:  # the same ops in one C++ call (cpu/llama_layers.cpp)
            weights, formats, parts, biases, activations, k, v, table, start, stop = step
            x = torch.ops.specdec_internal.llama_layers(
                x, cos, sin, weights, formats, parts, biases, [layer.input_layernorm for layer in layers],
                [layer.post_attention_layernorm for layer in layers], eps, hq, hkv, activations, k, v, seqlens, table,
                start, stop, tree_mask if tree_mask is None else tree_mask.contiguous(), qo_indptr, captured,
                list(capture), list(cache_layers) if len(cache_layers) < c.num_hidden_layers else [])
            layers = []
        else:
            h = rms_norm(x, layers[0].input_layernorm, eps)
        for i, layer in enumerate(layers):
            q, k, v = rotary_split(linear(h, layer.qkv_proj, layer.qkv_bias), cos, sin, hq, hkv, fused)
            attn = self.attention(q, k, v, kv_cache, cache_layers[i], cache_rows, tree_mask, qo_indptr)
            x, h = add_rms_norm(x, linear(attn.reshape(b, n, hq * d), layer.o_proj), layer.post_attention_layernorm,
                                eps, fused)
            mlp = linear(silu_mul(linear(h, layer.gate_up_proj), fused), layer.down_proj)
            if i + 1 < len(layers):  # the next layer's input norm, with the residual add
                x, h = add_rms_norm(x, mlp, layers[i + 1].input_layernorm, eps, fused)
            else:
                x = x + mlp
            if i in capture:
                j = capture.index(i) * c.hidden_size
                if torch.is_grad_enabled() and x.requires_grad:
                    captured = torch.cat((captured[..., :j], x, captured[..., j + c.hidden_size:]), -1)
                else:
                    captured[..., j:j + c.hidden_size].copy_(x)  # x is added into in place (fused)
        hidden = x if not capture else captured
        if logits_indices is not None:
            idx = logits_indices.to(device=x.device, dtype=torch.long)
            idx = idx.expand(b, -1) if idx.dim() == 1 else idx
            x = x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        logits = linear(rms_norm(x, self.norm, c.rms_norm_eps), self.lm_head if lm_head is None else lm_head).float()
        return (logits, hidden) if output_hidden_states is not False else logits

    def check_layers(self, layers, output_hidden_states) -> tuple:
        """forward's `layers` checked -> the layer indices the forward runs (all of them for None)."""
        count = self.config.num_hidden_layers
        if layers is None:
            return tuple(range(count))
        if not isinstance(layers, tuple) or not layers or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count for i in layers) or \
                any(a >= b for a, b in zip(layers, layers[1:])):
            raise ValueError(f"LlamaForCausalLM: layers must be a non-empty tuple of increasing layer indices in "
                             f"[0, {count}), got {layers!r}")
        if not isinstance(output_hidden_states, bool):
            raise ValueError("LlamaForCausalLM: layers and output_hidden_states=(layers) do not combine")
        return layers

    def check_capture(self, output_hidden_states) -> tuple:
        """The layers whose outputs the forward returns side by side: () for a bool output_hidden_states."""
        if isinstance(output_hidden_states, bool):
            return ()
        layers = self.config.num_hidden_layers
        if not isinstance(output_hidden_states, tuple) or not output_hidden_states or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in output_hidden_states) \
                or len(set(output_hidden_states)) != len(output_hidden_states):
            raise ValueError(f"LlamaForCausalLM: output_hidden_states must be a bool or a tuple of distinct layer "
                             f"indices in [0, {layers}), got {output_hidden_states!r}")
        return output_hidden_states

    def cpu_step_args(self, x, kv_cache, rows: slice, n: int, qo_indptr, layers: list | None = None):
        """The arguments of the C++ layer loop (torch.ops.specdec_internal.llama_layers) for this forward, or None
        where the Python loop runs: no KV cache of ours (training, an engine's), attention through another backend
        (sim, reference), a block longer than verify_attention takes (chunked), norms of another dtype, weights kept
        with different activations, or cache_rows with a step."""
        from ..kv_cache import PagedKVCache, StaticKVCache

        if not isinstance(kv_cache, (StaticKVCache, PagedKVCache)) or self.ops is not native_ops or \
                (qo_indptr is None and n > MAX_ATTENTION_QUERIES) or self.layers[0].input_layernorm.dtype != x.dtype:
            return None
        weights, formats, parts, biases, modes = [], [], [], [], set()
        for layer in self.layers if layers is None else layers:  # the layers the forward runs
            biases.append(layer.qkv_bias)
            for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                if isinstance(w, torch.Tensor):
                    weights.append(w)
                    formats.append(0)
                    parts.append(1)
                    continue
                pieces = getattr(w, "parts", [w])
                weights += [piece.blocks for piece in pieces]
                formats += [piece.format for piece in pieces]
                parts.append(len(pieces))
                modes.add(w.activations)
        if len(modes) > 1:
            return None
        k, v, table = kv_cache.k, kv_cache.v, kv_cache.block_table
        start, stop, step = rows.indices(kv_cache.batch_size)
        if step != 1:
            return None
        if table is not None:
            table = table[rows]
        return weights, formats, parts, biases, modes.pop() if modes else "float", k, v, table, start, stop

    def prefill(self, kv_cache, rows: list, token_lists: list, *, output_hidden_states: bool | tuple = False):
        """Writes token_lists[i] into cache row rows[i] after its current length and advances it: every list in
        one forward (the flat form: a ragged batch), lists longer than verify_attention's limit in chunks of it,
        one forward per chunk (empty lists are skipped). Returns the number of forwards run, and with
        output_hidden_states also each list's hidden states [n_i, H] (or [n_i, len x H] for layer indices: forward)."""
        device, chunk = self.device, MAX_ATTENTION_QUERIES
        hidden_states = [[] for _ in rows]
        forwards, start = 0, 0
        while True:
            step = [(i, token_lists[i][start:start + chunk]) for i in range(len(rows)) if len(token_lists[i]) > start]
            if not step:
                break
            span = range(min(rows[i] for i, _ in step), max(rows[i] for i, _ in step) + 1)
            counts = {rows[i]: len(tokens) for i, tokens in step}
            kv_cache.reserve([counts[rows[i]] for i, _ in step], requests=[rows[i] for i, _ in step])
            qo_indptr = [0]
            for row in span:
                qo_indptr.append(qo_indptr[-1] + counts.get(row, 0))
            order = sorted(step, key=lambda item: rows[item[0]])  # the flat rows go in cache-row order
            ids = upload([t for _, tokens in order for t in tokens], torch.long, device).unsqueeze(0)
            rows_span = slice(span.start, span.stop)
            _, hidden = self(ids, kv_cache, qo_indptr=qo_indptr, cache_rows=rows_span,
                             output_hidden_states=output_hidden_states or True,
                             logits_indices=upload([qo_indptr[-1] - 1], torch.long, device))
            for i, _ in step:
                first = qo_indptr[rows[i] - span.start]
                hidden_states[i].append(hidden[0, first:first + counts[rows[i]]])
            kv_cache.advance([counts.get(row, 0) for row in span], rows_span)
            forwards += 1
            start += chunk
        if not output_hidden_states:
            return forwards
        width = self.config.hidden_size * max(1, len(self.check_capture(output_hidden_states)))
        empty = torch.empty(0, width, dtype=self.dtype, device=device)
        return forwards, [torch.cat(h) if len(h) > 1 else (h[0] if h else empty) for h in hidden_states]

    # Loaders (loaders.py); here so that they read as the class's constructors.
    @classmethod
    def from_pretrained(cls, path, *, dtype=torch.float32, device="cpu", keep_quantized=False,
                        activations: str | None = None) -> "LlamaForCausalLM":
        """A Hugging Face directory (config.json + *.safetensors, sharded or not) or a .gguf file. keep_quantized
        (GGUF): the Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights stay as stored (quantized.py), the activations and
        the other weights are `dtype`; activations: how those weights multiply ("float" or "int8", the
        `activations` property). Default: "int8" for weights kept quantised on the CPU (1.3x faster a decode step
        and 1.9x a verify block of 8 on the shipped model, as close to the float32 model as bfloat16 is:
        docs/decoding.md), "float" otherwise."""
        from .loaders import load_pretrained

        if activations is not None:
            check_activations("from_pretrained", activations)
        model = load_pretrained(cls, path, dtype=dtype, device=device, keep_quantized=keep_quantized)
        if activations is None:  # int8 where there is something to multiply on the integer kernels
            activations = "int8" if model.quantized_weights() and model.device.type == "cpu" else "float"
        if activations != "float":
            model.activations = activations
        return model

    @classmethod
    def from_hf(cls, hf_model, *, dtype=None, device=None) -> "LlamaForCausalLM":
        """A transformers LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM object."""
        from .loaders import load_from_hf

        return load_from_hf(cls, hf_model, dtype=dtype, device=device)

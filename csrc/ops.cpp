// The one list of ops: every schema of torch.ops.specdec (and, compiled with SPECDEC_SIM, of its
// emulated twin torch.ops.specdec_sim). Backends register implementations with TORCH_LIBRARY_IMPL.
#include <torch/library.h>

#include "specdec/library.h"

TORCH_LIBRARY(SPECDEC_LIB, m) {
  // Uniforms in (0, 1) from Philox4x32-10: row b is the stream `stream` of request (seed[b], offset[b]),
  // element i its i-th uniform (counter layout in specdec/philox.h). -> [B, n] float32.
  m.def("philox_uniform(Tensor seed, Tensor offset, int n, int stream=0) -> Tensor");

  // Chain speculative sampling (docs/design.md §3.1). Writes output_token_ids [B, K+1] int32 (accepted drafts, then
  // the resampled or bonus token, then -1) and num_accepted [B] int32; ORs the invalid-input bits into
  // error_flags when given (the CPU kernel raises on them instead). Engine layouts (docs/design.md §3.4): with
  // cu_num_draft_tokens [B] the inputs are flat (draft_token_ids [T], rows [T + B, V] / [T, V]), num_draft_tokens
  // is None or a [B] cap on each request's judged drafts (in [0, cu[b] - cu[b-1]]), K being output_token_ids' width
  // less one (max_draft_tokens); bonus_token_ids [B] replaces the bonus
  // draw; uniforms ([B, K] or [T]) and final_uniforms [B] replace the Philox draws; target_to_draft [V] int32 maps
  // target ids to the columns of draft rows with a reduced vocabulary (-1: none); accepted_independently [B] gets
  // FlashInfer's count of drafts accepted when each is judged on its own. verification="block": a sampled request's
  // drafts are judged jointly (Sun et al. 2024; specdec/chain_sampling.h, chain_block_verify), not with
  // coupling="gumbel" or accepted_independently; "token" (default): one by one.
  m.def(
      "chain_speculative_sampling(Tensor draft_token_ids, Tensor target_probs, Tensor? draft_probs, "
      "Tensor? num_draft_tokens, Tensor greedy, Tensor seed, Tensor offset, Tensor(a!) output_token_ids, "
      "Tensor(b!) num_accepted, Tensor(c!)? error_flags, Tensor? cu_num_draft_tokens=None, "
      "Tensor? bonus_token_ids=None, Tensor? uniforms=None, Tensor? final_uniforms=None, Tensor? target_to_draft=None, "
      "Tensor(d!)? accepted_independently=None, str coupling=\"rejection\", str verification=\"token\") -> ()");
  // The same from logits: softmax(logits / temperature[b]) in float32 inside the kernel; temperature 0 = greedy.
  // top_k [B] int32 (0: off), top_p [B] float32 (1: off), min_p [B] float32 (0: off) process every target and draft
  // row of a sampled request inside the kernel, after temperature, in transformers' order (specdec/row_filter.h).
  // target_lse / draft_lse: the caller's normalisers of the rows, ln sum exp(logits / temperature) over each processed
  // row (the rows' shape less V, float32), which replace the rows' statistics pass; check_lse (strict mode) computes
  // the statistics anyway and records a value off them. row_lse [B] (K = 0): writes each request's row-0 normaliser
  // instead of sampling (logits_normalizer).
  m.def(
      "chain_speculative_sampling_from_logits(Tensor draft_token_ids, Tensor target_logits, Tensor? draft_logits, "
      "Tensor? num_draft_tokens, Tensor temperature, Tensor seed, Tensor offset, Tensor(a!) output_token_ids, "
      "Tensor(b!) num_accepted, Tensor(c!)? error_flags, Tensor? cu_num_draft_tokens=None, "
      "Tensor? bonus_token_ids=None, Tensor? uniforms=None, Tensor? final_uniforms=None, Tensor? target_to_draft=None, "
      "Tensor(d!)? accepted_independently=None, str coupling=\"rejection\", Tensor? top_k=None, Tensor? top_p=None, "
      "Tensor? min_p=None, str verification=\"token\", Tensor? target_lse=None, Tensor? draft_lse=None, "
      "bool check_lse=False, Tensor(e!)? row_lse=None) -> ()");

  // coupling="gumbel" (every sampling op): a sampled request's token at row i is the Gumbel-max sample of the row with
  // the noise of position offset[b] + i (a tree node: + its depth), uniform v of Philox stream 2 for token v
  // (specdec/sampling_math.h); a draft is accepted when it equals that token. Draft rows, uniforms and
  // final_uniforms are not taken. "rejection" (default): min(1, p/q) acceptance with residual resampling.

  // Tree speculative sampling (README "Tree speculation", specdec/tree_sampling.h): per request a tree of N <= 64
  // nodes (parents [B, N] int32, -1 for the root and padding; candidate_token_ids [B, N] int32/int64; num_nodes
  // [B] int32), target rows at every node [B, N, V], optionally the draft rows each node's children were
  // sampled from without replacement [B, N, V]. Writes the accepted path's tokens then the last token
  // (output_token_ids [B, N] int32, -1 padded), its node indices from the root (accepted_nodes [B, N] int32, -1
  // padded) and num_accepted [B] int32; ORs invalid-input bits into error_flags (the CPU kernel raises instead).
  // uniforms [B, N] (node c's acceptance draw in column c), final_uniforms [B] and target_to_draft [V] as for chains.
  // With cu_num_draft_tokens [B] (num_nodes None) the trees are flat: request b's k_b + 1 nodes (root first) at
  // cu[b-1] + b of parents, candidate_token_ids, the rows [T + B, V] and uniforms [T + B]; outputs [B, N].
  m.def(
      "tree_speculative_sampling(Tensor parents, Tensor candidate_token_ids, Tensor? num_nodes, Tensor target_probs, "
      "Tensor? draft_probs, Tensor greedy, Tensor seed, Tensor offset, Tensor(a!) output_token_ids, "
      "Tensor(b!) accepted_nodes, Tensor(c!) num_accepted, Tensor(d!)? error_flags, Tensor? uniforms=None, "
      "Tensor? final_uniforms=None, Tensor? target_to_draft=None, Tensor? cu_num_draft_tokens=None, "
      "str coupling=\"rejection\") -> ()");
  m.def(
      "tree_speculative_sampling_from_logits(Tensor parents, Tensor candidate_token_ids, Tensor? num_nodes, "
      "Tensor target_logits, Tensor? draft_logits, Tensor temperature, Tensor seed, Tensor offset, "
      "Tensor(a!) output_token_ids, Tensor(b!) accepted_nodes, Tensor(c!) num_accepted, Tensor(d!)? error_flags, "
      "Tensor? uniforms=None, Tensor? final_uniforms=None, Tensor? target_to_draft=None, "
      "Tensor? cu_num_draft_tokens=None, str coupling=\"rejection\", Tensor? top_k=None, Tensor? top_p=None, "
      "Tensor? min_p=None, Tensor? target_lse=None, Tensor? draft_lse=None, bool check_lse=False) -> ()");

  // KV-cache truncation after verification (docs/design.md §3.3, §3.4): cache_seqlens[b] += num_kept[b]; with
  // kept_indices (tree), block slot kept_indices[b, j] moves to block slot j in every layer; with clear, the
  // discarded slots of the block are zeroed. Layers are the lists k_caches / v_caches: NHD or HND (kv_layout),
  // contiguous, or paged (any page stride) through block_table or the CSR table kv_indptr / kv_indices.
  // block_len (the verified block's Q) is needed with kept_indices or clear; without it, only the lengths
  // change and num_kept is bounded by the cache. Rejected requests are left untouched; their error bits go to
  // error_flags when given (the CPU kernel raises instead).
  m.def(
      "truncate_kv_cache(Tensor(a!) cache_seqlens, Tensor num_kept, Tensor? kept_indices, Tensor(b!)[] k_caches, "
      "Tensor(c!)[] v_caches, Tensor? block_table, int? block_len, bool clear, Tensor(d!)? error_flags, "
      "Tensor? kv_indptr=None, Tensor? kv_indices=None, str kv_layout=\"NHD\") -> ()");

  // y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) for M <= 16 rows (decode and verify steps of a model):
  // bound by reading the weight once, which the CPU kernel does with every core. float32 or bfloat16.
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");

  // The same product with the weight kept as GGUF blocks: qweight [N, row_bytes] uint8, format a GGML type id
  // (Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q6_K 14); x [M, K] float32, bfloat16 or float16 (any M), accumulated in
  // float32, the weights decoded in registers or cache, never in memory; activations="int8": x quantised to 8 bits
  // per 32 values first (the CPU multiplies on integer dot products). dequantize: the blocks as float32 [N, K].
  m.def("quantized_linear(Tensor x, Tensor qweight, int format, Tensor? bias, str activations=\"float\") -> Tensor");
  m.def("dequantize(Tensor qweight, int format) -> Tensor");

  // A Llama decoder layer's elementwise steps in one call each (CPU; models/llama.py uses them there, torch's
  // expressions elsewhere; cpu/model_glue.cpp says what each computes). add_rms_norm adds delta into x in place.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_split(Tensor qkv, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");

  // Attention of the new tokens of each request against its KV cache (docs/design.md §3.2, §3.4; layouts in
  // specdec/attention.h); k_new/v_new, when given, are written into the cache at positions length_b + i first.
  // Writes out (q's shape and dtype) and, when given, lse (q's shape without D, float32). q is padded
  // [B, Q, Hq, D], or flat [T, Hq, D] with qo_indptr [B+1]. The cache is NHD or HND (kv_layout), contiguous or
  // paged through block_table or the CSR table (kv_indptr, kv_indices, kv_last_page_len; cache_seqlens is then
  // None: the table's kv length includes the new tokens). window_left -1 and logits_soft_cap 0 are off.
  // softmax_scale None means 1/sqrt(D). error_flags, when given, collects AttentionError bits of invalid
  // requests on CUDA (whose outputs are NaN); the CPU kernel raises instead.
  m.def(
      "verify_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? cache_seqlens, Tensor? k_new, "
      "Tensor? v_new, Tensor? block_table, Tensor? tree_mask, float? softmax_scale, Tensor(c!) out, Tensor(d!)? lse, "
      "Tensor(e!)? error_flags, Tensor? qo_indptr=None, Tensor? kv_indptr=None, Tensor? kv_indices=None, "
      "Tensor? kv_last_page_len=None, str kv_layout=\"NHD\", int window_left=-1, float logits_soft_cap=0.0) -> ()");
}

"""`flashinfer.BatchPrefillWithPagedKVCacheWrapper` (plan / run) on specdec_ext.verify_attention, for the verify step
of speculative decoding; follows the contract of FlashInfer 0.7.0rc3 to 0.7.4 (flashinfer/prefill.py).

The same calls as FlashInfer's: `plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
num_qo_heads, num_kv_heads, head_dim_qk, page_size, ...)` once per step, then `run(q, paged_kv_cache)` per layer with
q [T, Hq, D] (request b's rows qo_indptr[b] .. qo_indptr[b+1]) and the cache as one tensor [pages, 2, page_size, H, D]
(NHD) / [pages, 2, H, page_size, D] (HND), or a (k_cache, v_cache) tuple of [pages, page_size, H, D] / [pages, H,
page_size, D], read zero-copy. As in FlashInfer the page table describes the KV after this step's tokens were written:
kv_len_b = (pages_b - 1) * page_size + last_page_len_b includes request b's qo_len_b new tokens, which sit at the end.

Masks, as FlashInfer's: causal=True: query i sees KV positions <= kv_len - qo_len + i; causal=False without a mask:
every query sees all kv_len positions; custom_mask: flat bool, request b's [qo_len_b, kv_len_b] row-major (True =
visible); packed_custom_mask: that mask as plan() packs it, uint8, request b's qo_len_b * kv_len_b bits from a byte
boundary, little-endian bit order (FlashInfer's segment_packbits; equal to packbits(custom_mask, "little") when there
is one request). The mask is converted in plan() to the kernel's [Q, Q] mask over the new tokens.
run(..., return_lse=True) returns the log-sum-exp in base 2 [T, Hq], as FlashInfer's; FlashInfer 0.7.4's lse_base="ln"
(natural log) and lse_layout="HN" ([Hq, T], contiguous) are followed too.

Supported: qo_len_b in [0, LIMITS["max_verify_queries"]], head_dim_vo == head_dim_qk, pos_encoding_mode "NONE",
window_left, logits_soft_cap, sm_scale, q_scale / k_scale / v_scale as Python numbers, use_cuda_graph (plan copies the
table into the buffers given, as FlashInfer's), index tables in int64 as FlashInfer's (the kernel reads int32).
Refused with ValueError naming the argument: an index table holding a value outside int32's range (never wrapped),
masks that hide part of a request's prefix (not a verify step), RoPE / ALiBi inside attention, multi-item scoring,
attention sinks, custom JIT variants (jit_args, variant_owns_mask, extra run arguments), scale factors of an FP4 /
FP8 KV cache (kv_cache_sf, use_token_head_sf), skip-softmax sparsity (skip_softmax_threshold_scale_factor: an
approximation). Scheduling knobs (backend, fixed_split_size, disable_split_kv, max_*, uniform_q_len,
use_fp16_qk_reduction, enable_pdl, non_blocking, the data-type hints, and trtllm-gen's cubin choices use_fp16_softmax /
uses_spcompress) are accepted and ignored: the kernel's result does not depend on them (softmax and QK reduction are
always float32). max_total_num_rows (0.7.4, CUDA-graph mode) is checked as FlashInfer checks it.
Known difference: a packed_custom_mask passed to FlashInfer's plan directly is addressed with bit offsets as byte
offsets; here it is read in the layout FlashInfer's own packing produces, described above.
"""
import functools
import math

import torch

from ... import ops
from .. import backend as _backend

_OP = "BatchPrefillWithPagedKVCacheWrapper"
_BACKENDS = ("auto", "fa2", "fa3", "cudnn", "trtllm-gen", "cute-dsl", "cute-dsl-prims")
_LSE_BASES, _LSE_LAYOUTS = ("log2", "ln"), ("NH", "HN")
_LOG2E = 1.0 / math.log(2.0)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FITS_INT32 = (torch.int32, torch.int16, torch.int8, torch.uint8)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_OP}.plan: {name} must be a positive int, got {value!r}")
    return value


def _index_table(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or \
            t.dtype == torch.bool:
        raise ValueError(f"{_OP}.plan: {name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t).__name__)} "
                         f"{tuple(getattr(t, 'shape', ()))}")
    # plan() hands the kernel int32 tables: a wider table (FlashInfer's plan takes int64) must fit, or the conversion
    # would wrap (page 2**32 + 1 would read page 1). A host read, as the op's own check of an int64 table.
    if t.dtype not in _FITS_INT32 and t.numel():
        low, high = int(t.min()), int(t.max())
        if low < _INT32_MIN or high > _INT32_MAX:
            raise ValueError(f"{_OP}.plan: {name} holds values outside the int32 range (min {low}, max {high})")
    return t


def _host_index(t, name: str) -> torch.Tensor:
    """A 1-D integer table (qo_indptr, ...) read to the host: plan() is a host step, in FlashInfer too."""
    return _index_table(t, name).to("cpu", torch.int64)


def _unpack_bits(packed, lengths: list) -> torch.Tensor:
    """packed_custom_mask -> the flat bool custom_mask: request b's lengths[b] bits from a byte boundary, bit j of a
    byte being element j (little-endian bit order)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"{_OP}.plan: packed_custom_mask must be a 1-D uint8 tensor, got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)}")
    nbytes = [-(-n // 8) for n in lengths]
    if packed.numel() != sum(nbytes):
        raise ValueError(f"{_OP}.plan: packed_custom_mask has {packed.numel()} bytes; FlashInfer's packing of the "
                         f"masks (each request's qo_len * kv_len bits from a byte boundary) has {sum(nbytes)}")
    bits = ((packed.cpu().unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(-1)
    starts = [8 * s for s in torch.tensor([0] + nbytes[:-1], dtype=torch.int64).cumsum(0).tolist()] if lengths else []
    return torch.cat([bits[s:s + n] for s, n in zip(starts, lengths)] + [torch.zeros(0, dtype=torch.bool)])


def _new_token_mask(custom: torch.Tensor, qo_lens: list, kv_lens: list) -> torch.Tensor:
    """FlashInfer's flat [qo_len, kv_len] masks -> the kernel's flat [qo_len, qo_len] masks over the new tokens (the
    last qo_len KV positions); the prefix must be visible to every query."""
    parts, offset = [], 0
    for b, (n, s) in enumerate(zip(qo_lens, kv_lens)):
        block = custom[offset:offset + n * s].view(n, s)
        offset += n * s
        hidden = ~block[:, :s - n]
        if hidden.any():
            i, j = hidden.nonzero()[0].tolist()
            raise ValueError(f"{_OP}.plan: custom_mask hides KV position {j} of request {b}'s prefix from its query "
                             f"{i}; "
                             "only masks over the new tokens (the last qo_len positions) are supported, with the whole "
                             "prefix visible, as in a verify step")
        parts.append(block[:, s - n:].reshape(-1))
    return torch.cat(parts + [torch.zeros(0, dtype=torch.bool)])


class BatchPrefillWithPagedKVCacheWrapper:
    """FlashInfer's paged prefill/append attention wrapper for verify-sized blocks (module docstring)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
                 variant_owns_mask=False, max_total_num_rows=None):
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise ValueError(f"{_OP}: float_workspace_buffer must be a tensor (it sets the device; this kernel needs "
                             "no workspace)")
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f'{_OP}: kv_layout must be "NHD" or "HND", got {kv_layout!r}')
        if backend not in _BACKENDS:
            raise ValueError(f"{_OP}: backend must be one of {_BACKENDS}, got {backend!r}")
        if jit_args is not None or jit_kwargs is not None or variant_owns_mask:
            raise ValueError(f"{_OP}: jit_args / jit_kwargs / variant_owns_mask (custom attention variants) are not "
                             "supported")
        if max_total_num_rows is not None:
            if not use_cuda_graph:
                raise ValueError(f"{_OP}: max_total_num_rows requires use_cuda_graph=True")
            if isinstance(max_total_num_rows, bool) or not isinstance(max_total_num_rows, int) or \
                    max_total_num_rows < 0:
                raise ValueError(f"{_OP}: max_total_num_rows must be a nonnegative int, got {max_total_num_rows!r}")
        self._max_total_num_rows = max_total_num_rows
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._graph_bufs = None
        if self._use_cuda_graph:
            bufs = {"qo_indptr_buf": qo_indptr_buf, "paged_kv_indptr_buf": paged_kv_indptr_buf,
                    "paged_kv_indices_buf": paged_kv_indices_buf,
                    "paged_kv_last_page_len_buf": paged_kv_last_page_len_buf}
            for name, t in bufs.items():
                # The captured run reads these very tensors: int32 and contiguous, so that the op uses them uncopied.
                if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32 or \
                        not t.is_contiguous() or t.device != self.device:
                    raise ValueError(f"{_OP}: with use_cuda_graph=True, {name} must be a contiguous 1-D int32 tensor "
                                     f"on {self.device}")
            batch = qo_indptr_buf.numel() - 1
            if paged_kv_indptr_buf.numel() != batch + 1 or paged_kv_last_page_len_buf.numel() != batch:
                raise ValueError(f"{_OP}: paged_kv_indptr_buf must have batch_size + 1 = {batch + 1} entries and "
                                 f"paged_kv_last_page_len_buf batch_size = {batch}")
            self._graph_bufs = tuple(bufs.values())
            # The new-token masks of up to batch requests of the most rows each, at one address for every replay.
            self._mask_buf = torch.zeros(batch * ops.LIMITS["max_verify_queries"] ** 2, dtype=torch.bool,
                                         device=self.device)
        self._planned = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        """Accepted for FlashInfer's API: this kernel uses no workspace."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False,
             uniform_q_len=None, use_token_head_sf=False) -> None:
        """Checks the batch and converts its mask (a host step, as FlashInfer's plan); run() then launches only the
        kernel. Arguments as FlashInfer's (module docstring for what is refused)."""
        if pos_encoding_mode != "NONE":
            raise ValueError(f"{_OP}.plan: pos_encoding_mode {pos_encoding_mode!r} is not supported: apply the "
                             f"position "
                             'encoding to q and k before attention and pass "NONE"')
        if use_token_head_sf:
            raise ValueError(f"{_OP}.plan: use_token_head_sf (an FP8 KV cache with per-token scales) is not supported")
        if uniform_q_len is not None and (isinstance(uniform_q_len, bool) or not isinstance(uniform_q_len, int)):
            raise ValueError(f"{_OP}.plan: uniform_q_len must be an int or None, got {uniform_q_len!r}")
        for name, value in (("prefix_len_ptr", prefix_len_ptr), ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                            ("max_item_len_ptr", max_item_len_ptr)):
            if value is not None:
                raise ValueError(f"{_OP}.plan: {name} (multi-item scoring masks) is not supported")
        num_qo_heads, num_kv_heads = _positive_int(num_qo_heads, "num_qo_heads"), _positive_int(num_kv_heads,
                                                                                                "num_kv_heads")
        head_dim_qk, page_size = _positive_int(head_dim_qk, "head_dim_qk"), _positive_int(page_size, "page_size")
        if head_dim_vo is not None and head_dim_vo != head_dim_qk:
            raise ValueError(f"{_OP}.plan: head_dim_vo {head_dim_vo} != head_dim_qk {head_dim_qk} is not supported")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{_OP}.plan: num_qo_heads {num_qo_heads} must be a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
            raise ValueError(f"{_OP}.plan: window_left must be an int, -1 (off) or >= 0, got {window_left!r}")
        if o_data_type is not None and not isinstance(o_data_type, torch.dtype):
            o_data_type = getattr(torch, str(o_data_type), None)
            if not isinstance(o_data_type, torch.dtype):
                raise ValueError(f"{_OP}.plan: o_data_type must be a torch dtype or its name")

        qo, kv_ptr = _host_index(qo_indptr, "qo_indptr"), _host_index(paged_kv_indptr, "paged_kv_indptr")
        last = _host_index(paged_kv_last_page_len, "paged_kv_last_page_len")
        indices = _index_table(paged_kv_indices, "paged_kv_indices")
        batch = qo.numel() - 1
        if batch < 0 or kv_ptr.numel() != batch + 1 or last.numel() != batch:
            raise ValueError(f"{_OP}.plan: qo_indptr and paged_kv_indptr must have batch_size + 1 entries and "
                             f"paged_kv_last_page_len batch_size, got {qo.numel()}, {kv_ptr.numel()}, {last.numel()}")
        qo_lens, pages = (qo[1:] - qo[:-1]).tolist(), (kv_ptr[1:] - kv_ptr[:-1]).tolist()
        limit = ops.LIMITS["max_verify_queries"]
        for b, n in enumerate(qo_lens):
            if not 0 <= n <= limit:
                raise ValueError(f"{_OP}.plan: qo_indptr gives request {b} {n} query rows; this kernel takes 0 to "
                                 f"{limit} per request (a verify block)")
        if batch and (int(qo[0]) < 0 or int(kv_ptr[0]) < 0 or min(pages) < 0 or int(kv_ptr[-1]) > indices.numel()):
            raise ValueError(f"{_OP}.plan: paged_kv_indptr must start at >= 0, not decrease and end within "
                             f"paged_kv_indices ({indices.numel()} entries), and qo_indptr start at >= 0")
        kv_lens = []
        for b, (n, p, last_len) in enumerate(zip(qo_lens, pages, last.tolist())):
            if p and not 1 <= last_len <= page_size:
                raise ValueError(f"{_OP}.plan: paged_kv_last_page_len[{b}] = {last_len} is outside [1, page_size = "
                                 f"{page_size}]")
            kv_lens.append((p - 1) * page_size + last_len if p else 0)
            if kv_lens[-1] < n:
                raise ValueError(f"{_OP}.plan: request {b} has {n} query rows but a KV length of {kv_lens[-1]} from "
                                 "paged_kv_indptr / paged_kv_last_page_len, which must include the new tokens")
        for name, given, derived in (("seq_lens", seq_lens, kv_lens), ("seq_lens_q", seq_lens_q, qo_lens)):
            if given is not None and torch.as_tensor(given).cpu().flatten().tolist() != derived:
                raise ValueError(f"{_OP}.plan: {name} disagrees with the lengths of the page table / qo_indptr")

        if packed_custom_mask is not None:  # FlashInfer's precedence: the packed mask wins
            custom = _unpack_bits(packed_custom_mask, [n * s for n, s in zip(qo_lens, kv_lens)])
        elif custom_mask is not None:
            if not isinstance(custom_mask, torch.Tensor) or custom_mask.dtype != torch.bool:
                raise ValueError(f"{_OP}.plan: custom_mask must be a flat bool tensor (True = visible), got "
                                 f"{getattr(custom_mask, 'dtype', type(custom_mask).__name__)}")
            custom = custom_mask.cpu().reshape(-1)
            expected = sum(n * s for n, s in zip(qo_lens, kv_lens))
            if custom.numel() != expected:
                raise ValueError(f"{_OP}.plan: custom_mask has {custom.numel()} entries; sum of qo_len * kv_len over "
                                 f"the "
                                 f"requests is {expected}")
        else:
            custom = None
        if custom is not None:
            mask = _new_token_mask(custom, qo_lens, kv_lens)
        elif causal:
            mask = None  # the kernel's default: new token j visible to query i when j <= i
        else:
            mask = torch.ones(sum(n * n for n in qo_lens), dtype=torch.bool)

        if self._use_cuda_graph:
            qo_buf, kv_ptr_buf, indices_buf, last_buf = self._graph_bufs
            if batch != qo_buf.numel() - 1:
                raise ValueError(f"{_OP}.plan: batch size {batch} differs from the {qo_buf.numel() - 1} of the "
                                 f"CUDA-graph "
                                 "buffers")
            if self._max_total_num_rows is not None and int(qo[-1]) > self._max_total_num_rows:
                raise ValueError(f"{_OP}.plan: {int(qo[-1])} query rows, more than max_total_num_rows = "
                                 f"{self._max_total_num_rows}")
            if indices.numel() > indices_buf.numel():
                raise ValueError(f"{_OP}.plan: paged_kv_indices has {indices.numel()} entries, more than "
                                 f"paged_kv_indices_buf's {indices_buf.numel()}")
            qo_buf.copy_(qo)
            kv_ptr_buf.copy_(kv_ptr)
            last_buf.copy_(last)
            indices_buf[:indices.numel()].copy_(indices)
            if mask is not None:
                self._mask_buf[:mask.numel()].copy_(mask)
                mask = self._mask_buf  # longer than the masks: the kernel finds each request's from qo_indptr
            tables = self._graph_bufs
        else:
            tables = tuple(t.to(self.device, torch.int32) for t in (qo_indptr, paged_kv_indptr, indices,
                                                                     paged_kv_last_page_len))
            mask = None if mask is None else mask.to(self.device)
        self._planned = {"tables": tables, "mask": mask, "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads,
                         "head_dim": head_dim_qk, "page_size": page_size, "sm_scale": sm_scale,
                         "window_left": window_left, "logits_soft_cap": float(logits_soft_cap or 0.0),
                         "o_data_type": o_data_type}

    begin_forward = plan

    def _caches(self, paged_kv_cache):
        if isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2:
            return paged_kv_cache[:, 0], paged_kv_cache[:, 1]  # strided page views, read in place
        if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2 and \
                all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in paged_kv_cache):
            return tuple(paged_kv_cache)
        raise ValueError(f"{_OP}.run: paged_kv_cache must be one [pages, 2, ...] 5-D tensor or a (k_cache, v_cache) "
                         "tuple of 4-D tensors")

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None, window_left=None, sinks=None,
            kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None, uses_spcompress=None):
        """Attention of q [T, Hq, D] against the paged cache for the planned batch: out [T, Hq, D] (rows no request
        owns are left as they are: zeros when out is None), and with return_lse the log-sum-exp, float32, in base 2
        (lse_base "log2") or e ("ln"), [T, Hq] (lse_layout "NH") or [Hq, T] ("HN"), written into lse when given."""
        plan = self._planned
        if plan is None:
            raise RuntimeError(f"{_OP}.run: call plan() first")
        if args:
            raise ValueError(f"{_OP}.run: extra positional arguments (custom JIT variants) are not supported")
        if sinks is not None:
            raise ValueError(f"{_OP}.run: sinks (attention sinks) are not supported")
        if kv_cache_sf is not None:
            raise ValueError(f"{_OP}.run: kv_cache_sf (scale factors of an FP4 / FP8 KV cache) is not supported")
        if skip_softmax_threshold_scale_factor is not None:
            raise ValueError(f"{_OP}.run: skip_softmax_threshold_scale_factor (skip-softmax sparsity) approximates "
                             "attention and is not supported")
        if lse_base not in _LSE_BASES or lse_layout not in _LSE_LAYOUTS:
            raise ValueError(f"{_OP}.run: lse_base must be one of {_LSE_BASES} and lse_layout one of {_LSE_LAYOUTS}, "
                             f"got {lse_base!r}, {lse_layout!r}")
        if window_left is not None and window_left != plan["window_left"]:
            raise ValueError(f"{_OP}.run: window_left {window_left} differs from plan()'s {plan['window_left']}")
        k_cache, v_cache = self._caches(paged_kv_cache)
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1:] != (plan["num_qo_heads"], plan["head_dim"]):
            raise ValueError(f"{_OP}.run: q must be [T, num_qo_heads = {plan['num_qo_heads']}, head_dim = "
                             f"{plan['head_dim']}], got {tuple(getattr(q, 'shape', ()))}")
        nhd = self._kv_layout == "NHD"
        page_size, heads = (k_cache.shape[1], k_cache.shape[2]) if nhd else (k_cache.shape[2], k_cache.shape[1])
        if page_size != plan["page_size"]:
            raise ValueError(f"{_OP}.run: paged_kv_cache has pages of {page_size} tokens but plan() was given "
                             f"page_size {plan['page_size']}")
        if heads != plan["num_kv_heads"]:
            raise ValueError(f"{_OP}.run: paged_kv_cache has {heads} KV heads but plan() was given num_kv_heads "
                             f"{plan['num_kv_heads']}")
        if plan["o_data_type"] not in (None, q.dtype):
            raise ValueError(f"{_OP}.run: o_data_type {plan['o_data_type']} differs from q's {q.dtype}; the output "
                             "has q's dtype")
        scale = plan["sm_scale"] if plan["sm_scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))):
                raise ValueError(f"{_OP}.run: {name} must be a Python number here, got {type(s).__name__}")
        scale *= (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)
        if out is None:
            out = torch.zeros_like(q, memory_format=torch.contiguous_format)
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len = plan["tables"]
        result = _backend().verify_attention(q, k_cache, v_cache, qo_indptr=qo_indptr, kv_layout=self._kv_layout,
                                             kv_indptr=kv_indptr, kv_indices=kv_indices,
                                             kv_last_page_len=kv_last_page_len, tree_mask=plan["mask"],
                                             softmax_scale=scale, window_left=plan["window_left"],
                                             logits_soft_cap=plan["logits_soft_cap"], out=out, return_lse=return_lse)
        if v_scale is not None:
            out.mul_(v_scale)
        if not return_lse:
            return out
        natural = result[1]  # [T, Hq], base e
        scale = _LOG2E if lse_base == "log2" else 1.0  # FlashInfer's default log-sum-exp is in base 2
        shape = tuple(natural.shape) if lse_layout == "NH" else tuple(natural.shape[::-1])
        if lse is None:
            value = natural.mul_(scale)
            return out, value if lse_layout == "NH" else value.t().contiguous()
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != shape or lse.dtype != torch.float32 or \
                lse.device != q.device:
            raise ValueError(f"{_OP}.run: lse must be a float32 tensor of shape {shape} (lse_layout {lse_layout}) on "
                             f"{q.device}")
        torch.mul(natural if lse_layout == "NH" else natural.t(), scale, out=lse)
        return out, lse

    run_return_lse = functools.partialmethod(run, return_lse=True)

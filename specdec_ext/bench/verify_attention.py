"""verify_attention against SDPA, the reference, (--flex) FlexAttention and (--against flashinfer) FlashInfer;
--layouts: the engine layouts.

verify_attention against torch's scaled_dot_product_attention (explicit mask, enable_gqa), the reference, and with
--flex FlexAttention (torch.compile'd, one compile per shape), Hq/Hkv = 32/8, D = 128, every request with the same
context length. bytes are those that must move: every K and V row of the context and the new tokens once, q read and
out written once; floor_us is their time at the copy bandwidth measured in the run, of_floor = floor_us / graph_us
(graph_us: the op replayed from a CUDA graph on a GPU, the eager call on the CPU). plan is the CUDA kernel's split plan
for the row: split size x splits per request, and the blocks that do work (splits x KV heads x row tiles x B; an
H200's launch when run on the CPU). --against flashinfer adds FlashInfer's BatchPrefillWithPagedKVCacheWrapper
(its BatchDecodeWithPagedKVCacheWrapper at Q = 1) on the same values in its paged NHD layout (16-token pages), planned
outside the timing. --layouts times the engine layouts (HND, paged, FlashInfer's CSR pages, flat q) against the padded
NHD call of the same work instead.
"""
import statistics

import torch
import torch.nn.functional as F

import specdec_ext
from specdec_ext import reference

from ..factory import choose_device
from ..ops import _C
from .common import (
    add_common_arguments,
    copy_bandwidth_gbs,
    cuda_graph,
    import_flashinfer,
    int_list,
    median_us,
    print_row,
    report,
    save,
)

HQ, HKV, D = 32, 8, 128


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=None,
                        help="batch sizes B (default 1,8 on the CPU, 1,8,32 on a GPU; --layouts: the first, default 8)")
    parser.add_argument("--contexts", type=int_list, default=None,
                        help="context lengths, the cached tokens per request (default 512,4096 on the CPU, "
                             "512,4096,32768 on a GPU; --layouts: the first, default 2048)")
    parser.add_argument("--queries", type=int_list, default=[1, 5, 8],
                        help="new tokens Q per request, the verify block (default 1,5,8)")
    parser.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles per shape)")
    parser.add_argument("--against", choices=["flashinfer"], default=None,
                        help="also time FlashInfer's paged prefill (decode at Q = 1) wrapper on the same values, when "
                             "flashinfer imports (a GPU)")
    parser.add_argument("--layouts", action="store_true",
                        help="the engine layouts (HND, CSR pages, flat q) against the padded NHD call, one B and "
                             "context, Q = 8")
    add_common_arguments(parser)


def main(args) -> int:
    device = choose_device(args.device)
    if args.layouts:
        return main_layouts(args, device)
    peak = copy_bandwidth_gbs(device)
    cpu = device.type == "cpu"
    batches = args.batch or ([1, 8] if cpu else [1, 8, 32])
    contexts = args.contexts or ([512, 4096] if cpu else [512, 4096, 32768])
    dtype = torch.float32 if cpu else torch.bfloat16
    flashinfer = import_flashinfer(args.against == "flashinfer" and not cpu)
    if args.against == "flashinfer" and cpu:
        print("--against flashinfer: FlashInfer's attention wrappers need a GPU; no FlashInfer column", flush=True)
    rows = []
    for batch in batches:
        for context in contexts:
            for n_q in args.queries:
                rows.append(measure(batch, context, n_q, dtype, device, args.repeats, peak, args.flex, flashinfer))
                print_row(rows[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    columns = ["B", "context", "Q", "ours_us", "graph_us", "sdpa_us", "speedup"]
    columns += ["flex_us", "vs_flex"] if args.flex else []
    columns += ["flashinfer_us", "vs_flashinfer"] if flashinfer is not None else []
    report(f"verify_attention on {name} ({dtype}, Hq/Hkv = {HQ}/{HKV}, D = {D}; copy bandwidth {peak:.0f} GB/s)",
           rows, columns + ["reference_us", "bytes", "floor_us", "GB/s", "of_floor", "plan"])
    save(args, {"title": f"verify_attention, {name}", "device": name, "copy_bw_gbs": peak}, rows,
         ["B", "context", "Q"])
    return 0


def split_plan(batch, context, n_q) -> str:
    """The CUDA kernel's split plan for B requests of `context` cached tokens and Q new ones: "C x splits, blocks"."""
    keys = _C.attention_split_keys(context)
    splits = -(-(context + n_q) // keys)
    row_tiles = -(-(n_q * (HQ // HKV)) // 64)
    return f"{keys}x{splits}, {splits * HKV * row_tiles * batch} blocks"


def flashinfer_us(flashinfer, q, k_cache, v_cache, context, device, repeats) -> float:
    """FlashInfer's paged wrapper on the same values: the cache copied into 16-token NHD pages (request b's pages
    consecutive), planned once, then run() timed from a CUDA graph; NaN (the reason printed) if it fails here."""
    batch, n_q, page = q.shape[0], q.shape[1], 16
    try:
        s = k_cache.shape[1]
        per_seq = -(-s // page)
        pad = (0, 0, 0, 0, 0, per_seq * page - s)
        k_pages = F.pad(k_cache, pad).reshape(batch * per_seq, page, HKV, D)
        v_pages = F.pad(v_cache, pad).reshape(batch * per_seq, page, HKV, D)
        indptr = torch.arange(0, batch * per_seq + 1, per_seq, dtype=torch.int32, device=device)
        indices = torch.arange(batch * per_seq, dtype=torch.int32, device=device)
        last = torch.full((batch,), s - (per_seq - 1) * page, dtype=torch.int32, device=device)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        if n_q == 1:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(indptr, indices, last, HQ, HKV, D, page, q_data_type=q.dtype, kv_data_type=q.dtype)
            q_in = q[:, 0]
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            qo_indptr = torch.arange(0, batch * n_q + 1, n_q, dtype=torch.int32, device=device)
            wrapper.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, page, causal=True, q_data_type=q.dtype,
                         kv_data_type=q.dtype)
            q_in = q.reshape(batch * n_q, HQ, D)
        def call():
            return wrapper.run(q_in, (k_pages, v_pages))
        call()  # its first call compiles the kernel (JIT): outside the timing
        try:
            return median_us(cuda_graph(call).replay, device, repeats)
        except RuntimeError as error:  # not capturable as planned: timed from Python, launch included
            print(f"flashinfer attention timed eagerly ({str(error)[:80]})")
            return median_us(call, device, repeats)
    except Exception as error:  # a kernel that does not build or run here: NaN, the run goes on
        print(f"flashinfer attention failed ({type(error).__name__}: {str(error)[:120]})")
        return float("nan")


def measure(batch, context, n_q, dtype, device, repeats, peak, flex=False, flashinfer=None):
    g = torch.Generator().manual_seed(batch + context + n_q)
    s = context + n_q
    q = torch.randn(batch, n_q, HQ, D, generator=g).to(device=device, dtype=dtype)
    k_cache = torch.randn(batch, s, HKV, D, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(batch, s, HKV, D, generator=g).to(device=device, dtype=dtype)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    def ours():
        return specdec_ext.verify_attention(q, k_cache, v_cache, lengths)
    # SDPA on the same cache: [B, H, S, D] views, a [Q, S] mask (the cache, then causal over the new tokens).
    mask = torch.ones(n_q, s, dtype=torch.bool, device=device)
    mask[:, context:] = torch.ones(n_q, n_q, dtype=torch.bool, device=device).tril()
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    ours_us = median_us(ours, device, repeats)
    sdpa_us = median_us(sdpa, device, repeats)
    ref_us = median_us(lambda: reference.verify_attention(q, k_cache, v_cache, lengths, dtype=torch.float32), device,
                       max(3, repeats // 10), warmup=1)
    graph_us = median_us(cuda_graph(ours).replay, device, repeats) if device.type == "cuda" else ours_us
    nbytes = (2 * batch * s * HKV + 2 * batch * n_q * HQ) * D * k_cache.element_size()  # K, V; q and out
    gbs = nbytes / (graph_us * 1e-6) / 1e9
    row = {"B": batch, "context": context, "Q": n_q, "ours_us": ours_us, "graph_us": graph_us, "sdpa_us": sdpa_us,
           "speedup": sdpa_us / ours_us}
    if flex:
        flex_us = median_us(flex_attention_fn(qt, kt, vt, context), device, repeats)
        row.update(flex_us=flex_us, vs_flex=flex_us / ours_us)
    if flashinfer is not None:
        fi_us = flashinfer_us(flashinfer, q, k_cache, v_cache, context, device, repeats)
        row.update(flashinfer_us=fi_us, vs_flashinfer=fi_us / graph_us)
    floor_us = nbytes / (peak * 1e9) * 1e6
    return row | {"reference_us": ref_us, "bytes": nbytes, "floor_us": floor_us, "GB/s": gbs,
                  "of_floor": floor_us / graph_us, "plan": split_plan(batch, context, n_q)}


def flex_attention_fn(qt, kt, vt, context):
    """FlexAttention over the same [B, H, S, D] views with the verify mask as a mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def verify_mask(b, h, q_idx, kv_idx):
        return (kv_idx < context) | (kv_idx - context <= q_idx)

    block_mask = create_block_mask(verify_mask, None, None, qt.shape[2], kt.shape[2], device=qt.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(qt, kt, vt, block_mask=block_mask, enable_gqa=True)


def main_layouts(args, device) -> int:
    """`specdec bench verify_attention --layouts`: the engine layouts of verify_attention against the padded NHD call
    of the same work, in one run (median of repeats after warm-up each): HND caches, paged caches (block table;
    FlashInfer's interleaved HND pages through its CSR table), flat q with qo_indptr. B = 8 (the first of --batch),
    context 2048 (the first of --contexts), Q_b uniform in 1..8 from a fixed seed for the ragged rows."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batch = args.batch[0] if args.batch else 8
    context = args.contexts[0] if args.contexts else 2048
    n_q, page = 8, 16
    g = torch.Generator().manual_seed(2048)
    counts = torch.randint(1, n_q + 1, (batch,), generator=g).tolist()
    q = torch.randn(batch, n_q, HQ, D, generator=g).to(device=device, dtype=dtype)
    s = context + n_q
    k_cache = torch.randn(batch, s, HKV, D, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(batch, s, HKV, D, generator=g).to(device=device, dtype=dtype)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    k_hnd, v_hnd = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    # Paged: each request's pages scattered over one pool; FlashInfer's [pages, 2, H, page, D] for the CSR rows.
    per_seq = -(-s // page)
    table = torch.randperm(batch * per_seq, generator=g).int().reshape(batch, per_seq).to(device)
    k_pages = torch.empty(batch * per_seq, page, HKV, D, dtype=dtype, device=device)
    v_pages = torch.empty_like(k_pages)
    for b in range(batch):
        rows = table[b].long()
        tail = (0, 0, 0, 0, 0, per_seq * page - s)
        k_pages[rows] = F.pad(k_cache[b], tail).reshape(per_seq, page, HKV, D)
        v_pages[rows] = F.pad(v_cache[b], tail).reshape(per_seq, page, HKV, D)
    kv_fi = torch.stack([k_pages.transpose(1, 2), v_pages.transpose(1, 2)], dim=1).contiguous()
    kv_len = context + n_q
    indptr = torch.arange(0, batch * per_seq + 1, per_seq, dtype=torch.int32, device=device)
    last = torch.full((batch,), kv_len - (per_seq - 1) * page, dtype=torch.int32, device=device)
    flat_full = q.reshape(batch * n_q, HQ, D)
    full_indptr = torch.arange(0, batch * n_q + 1, n_q, dtype=torch.int32, device=device)
    ragged = torch.cat([q[b, :c] for b, c in enumerate(counts)])
    ragged_indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).int().to(device)
    f = specdec_ext.verify_attention
    cases = [
        ("contiguous NHD, padded Q = 8 (baseline)", lambda: f(q, k_cache, v_cache, lengths)),
        ("contiguous HND, padded Q = 8", lambda: f(q, k_hnd, v_hnd, lengths, kv_layout="HND")),
        ("flat q, qo_indptr with every Q_b = 8",
         lambda: f(flat_full, k_cache, v_cache, lengths, qo_indptr=full_indptr)),
        (f"flat q, qo_indptr with Q_b in 1..8 (T = {sum(counts)})",
         lambda: f(ragged, k_cache, v_cache, lengths, qo_indptr=ragged_indptr)),
        ("paged NHD, block table, padded Q = 8", lambda: f(q, k_pages, v_pages, lengths, block_table=table)),
        ("paged HND kv[:, 0] / kv[:, 1], CSR table, padded Q = 8",
         lambda: f(q, kv_fi[:, 0], kv_fi[:, 1], None, kv_indptr=indptr, kv_indices=table.reshape(-1),
                   kv_last_page_len=last, kv_layout="HND")),
    ]
    # Warm-up, then the cases timed round-robin (one call of each per round): a drift of the machine's speed during
    # the run (other work, clocks) moves every case alike instead of the ratios. Median per case.
    for _ in range(3):
        for _, fn in cases:
            fn()
    times = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, fn) in enumerate(cases):
            times[i].append(median_us(fn, device, repeats=1, warmup=0))
    rows = [{"layout": name, "us": statistics.median(t)} for (name, _), t in zip(cases, times)]
    base = rows[0]["us"]
    for row in rows:
        row["vs_baseline"] = row["us"] / base
        print(f"{row['layout']:58s} {row['us']:9.1f} us  {row['vs_baseline']:.3f}x", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"verify_attention layouts on {name} ({dtype}, B = {batch}, context {context}, Hq/Hkv = {HQ}/{HKV}, "
           f"D = {D}, ragged Q_b = {counts})", rows, ["layout", "us", "vs_baseline"])
    save(args, {"title": f"verify_attention layouts, {name}", "device": name, "counts": counts}, rows, ["layout"])
    return 0

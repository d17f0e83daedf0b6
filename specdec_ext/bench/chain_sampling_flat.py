"""chain_speculative_sampling in the flat form (vLLM's layout) against the pad copy and the padded call.

A mixed-length batch in the flat form (draft_token_ids [T], rows [T + B, V] with cu_num_draft_tokens) against what an
engine must do without it: copy the rows into the padded [B, K+1, V] layout, then make the padded call. Also the
padded call alone (the copy excluded), which the flat call must not be slower than: both read the same rows.
"""
import torch

import specdec_ext

from ..factory import choose_device
from .common import add_common_arguments, int_list, median_us, print_row, report, save


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[64], help="batch sizes B (default 64)")
    parser.add_argument("--k", type=int, default=8,
                        help="the largest draft count K: each request drafts k_b uniform in 0..K (default 8)")
    parser.add_argument("--vocab", type=int_list, default=[128256], help="vocabulary sizes V (default 128256)")
    add_common_arguments(parser)


def make_batch(batch, max_k, vocab, dtype, device, gen):
    """A flat batch with k_b uniform in [0, max_k], its padding index (flat row -> padded row) and the padded twin."""
    counts = torch.randint(0, max_k + 1, (batch,), generator=gen)
    total = int(counts.sum())
    logits = torch.randn(total + batch, vocab, generator=gen) * 2.5
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)[:-1]])
    # Flat target row r of request b (its k_b rows, then its bonus row) -> padded row b * (K + 1) + i.
    request = torch.repeat_interleave(torch.arange(batch), counts + 1)
    within = torch.arange(total + batch) - torch.repeat_interleave(starts + torch.arange(batch), counts + 1)
    target_index = request * (max_k + 1) + within
    draft_request = torch.repeat_interleave(torch.arange(batch), counts)
    draft_within = torch.arange(total) - torch.repeat_interleave(starts, counts)
    draft_index = draft_request * max_k + draft_within
    target_rows = torch.ones(total + batch, dtype=torch.bool)
    target_rows[starts + torch.arange(batch) + counts] = False  # the bonus rows
    draft_logits = logits[target_rows] + 0.8 * torch.randn(total, vocab, generator=gen)
    ids = torch.multinomial(torch.softmax(draft_logits, -1), 1, generator=gen).reshape(-1).int()
    def to(t):
        return t.to(device=device, dtype=dtype)
    return {"counts": counts.int().to(device), "cu": counts.cumsum(0).int().to(device), "ids": ids.to(device),
            "target_logits": to(logits), "draft_logits": to(draft_logits),
            "target_probs": to(torch.softmax(logits, -1)), "draft_probs": to(torch.softmax(draft_logits, -1)),
            "target_index": target_index.to(device), "draft_index": draft_index.to(device),
            "seed": torch.randint(0, 2**62, (batch,), generator=gen).to(device)}


def pad(flat, index, rows, width):
    """The engine's copy: flat rows into a zeroed [B, width, V] tensor."""
    padded = flat.new_zeros(rows * width, flat.shape[-1])
    padded.index_copy_(0, index, flat)
    return padded.view(rows, width, flat.shape[-1])


def main(args) -> int:
    device = choose_device(args.device)
    max_k = args.k
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in args.vocab:
            for batch in args.batch:
                case = make_batch(batch, max_k, vocab, dtype, device, torch.Generator().manual_seed(batch + vocab))
                for path in ("probs", "logits"):
                    rows.append(measure(case, path, batch, max_k, vocab, dtype, device, args.repeats))
                    print_row(rows[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"chain speculative sampling, flat vs padded, mixed-length batch (k_b uniform in 0..{max_k}) on {name}",
           rows, ["path", "dtype", "B", "V", "T", "flat_us", "padded_us", "pad_copy_us", "flat_vs_padded",
            "copy_and_padded_vs_flat"])
    save(args, {"title": f"flat vs padded chain sampling, {name}", "device": name}, rows, ["path", "dtype", "B", "V"])
    return 0


def measure(case, path, batch, max_k, vocab, dtype, device, repeats):
    ids, cu, counts, seed = case["ids"], case["cu"], case["counts"], case["seed"]
    target, draft = case[f"target_{path}"], case[f"draft_{path}"]
    ids_padded = pad(ids.view(-1, 1), case["draft_index"], batch, max_k).view(batch, max_k)
    target_padded = pad(target, case["target_index"], batch, max_k + 1)
    draft_padded = pad(draft, case["draft_index"], batch, max_k)
    if path == "probs":
        def run(i, t, d, **kw):
            return specdec_ext.chain_speculative_sampling(i, t, d, seed=seed, **kw)
    else:
        def run(i, t, d, **kw):
            return specdec_ext.chain_speculative_sampling_from_logits(i, t, d, temperature=1.0,
                                                                                            seed=seed, **kw)
    def flat():
        return run(ids, target, draft, cu_num_draft_tokens=cu, max_draft_tokens=max_k)
    def padded():
        return run(ids_padded, target_padded, draft_padded, num_draft_tokens=counts)

    def copy_and_padded():
        return run(pad(ids.view(-1, 1), case["draft_index"], batch, max_k).view(batch, max_k),
                   pad(target, case["target_index"], batch, max_k + 1), pad(draft, case["draft_index"], batch, max_k),
                   num_draft_tokens=counts)

    a, b = flat(), padded()
    assert torch.equal(a.output_token_ids, b.output_token_ids), "the flat form must equal the padded form"
    # Interleaved repeats, so that the three see the same machine state.
    flat_us, padded_us, both_us = [], [], []
    for _ in range(3):
        flat_us.append(median_us(flat, device, max(3, repeats // 3)))
        padded_us.append(median_us(padded, device, max(3, repeats // 3)))
        both_us.append(median_us(copy_and_padded, device, max(3, repeats // 3)))
    flat_us, padded_us, both_us = sorted(flat_us)[1], sorted(padded_us)[1], sorted(both_us)[1]
    return {"path": path, "dtype": str(dtype).replace("torch.", ""), "B": batch, "V": vocab, "T": int(ids.numel()),
            "flat_us": flat_us, "padded_us": padded_us, "pad_copy_us": both_us - padded_us,
            "flat_vs_padded": padded_us / flat_us, "copy_and_padded_vs_flat": both_us / flat_us}

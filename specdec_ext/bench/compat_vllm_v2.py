"""vLLM Model Runner V2's rejection_sample through the shim: its draft-logits gather against the op it feeds.

The shim specdec_ext.compat.vllm_v2 reads vLLM's per-request-state draft logits cache ([max_num_reqs, k, V],
pre-temperature) by gathering each draft position's row into a [T, V] float32 copy divided by the request's
temperature, then calls chain_speculative_sampling_from_logits on it. Timed at each shape: that gather alone (the
shim's indexing, its indices precomputed), the op alone on pre-gathered rows (the shim's other arguments), and the
whole shim call; gather_vs_op is the gather's time over the op's. Every request has k drafts drawn from its draft
rows, all sampled at temperature 1, its state a random slot of a cache twice the batch."""
import torch

from ..compat import backend
from ..compat import vllm_v2 as shim
from ..factory import choose_device
from .common import add_common_arguments, int_list, median_us, print_row, report, save


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[1, 8, 32], help="batch sizes B (default 1,8,32)")
    parser.add_argument("--k", type=int_list, default=[4], help="draft tokens per request k (default 4)")
    parser.add_argument("--vocab", type=int_list, default=[32000, 128256],
                        help="vocabulary sizes V (default 32000,128256)")
    add_common_arguments(parser, plot=False)


def make_case(batch, k, vocab, device, gen):
    """The shim's positional arguments in vLLM 0.34's layout, and the cache."""
    states = 2 * batch
    target = torch.randn(batch * (k + 1), vocab, generator=gen) * 3.0
    values = torch.randn(states, k, vocab, generator=gen) * 3.0
    idx_mapping = torch.randperm(states, generator=gen)[:batch]
    # Draft rows near the target's and the drafts drawn from them.
    values[idx_mapping] = target.view(batch, k + 1, vocab)[:, :k] + torch.randn(batch, k, vocab, generator=gen)
    drafts = torch.multinomial(torch.softmax(values[idx_mapping].view(-1, vocab), -1), 1, generator=gen).view(batch, k)
    draft_sampled = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), drafts], 1).view(-1)
    cu_num_logits = torch.arange(batch + 1, dtype=torch.int32) * (k + 1)
    local = torch.arange(k + 1).repeat(batch)
    pos = local + 1000 * torch.arange(batch).repeat_interleave(k + 1)
    args = [target, None, draft_sampled, cu_num_logits, pos, idx_mapping, idx_mapping.repeat_interleave(k + 1),
            local, torch.ones(states), torch.arange(states, dtype=torch.int64) + 1, k]
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    args[1] = shim_cache(values.to(device))
    return args


def shim_cache(values):
    """vLLM 0.34's DraftLogitsCache as the shim reads it (values, no row_mapping: the replicated cache)."""
    return type("DraftLogitsCache", (), {"values": values, "row_mapping": None})()


def measure(args, batch, k, vocab, device, repeats):
    target, cache, draft_sampled, cu_num_logits, pos, idx_mapping, _, _, temperature, seed, _ = args
    values = cache.values
    # The shim's indices, precomputed: every request has k drafts, so draft position t is request t // k's step t % k.
    owner = torch.arange(batch * k, device=device) // k
    step = torch.arange(batch * k, device=device) % k
    row = idx_mapping.long()
    scale = temperature[row].float()

    def gather():  # the shim's copy: values[row[owner], step].float() / scale[owner].unsqueeze(-1), [:, :vocab]
        return (values[row[owner], step].float() / scale[owner].unsqueeze(-1))[:, :vocab]

    rows = gather()
    ids = draft_sampled.view(batch, k + 1)[:, 1:].reshape(-1).int()
    cu_drafts = torch.arange(1, batch + 1, dtype=torch.int32, device=device) * k
    op_kwargs = dict(temperature=torch.ones(batch, device=device), seed=seed[row], offset=pos[::k + 1].long(),
                     cu_num_draft_tokens=cu_drafts, max_draft_tokens=k,
                     num_draft_tokens=torch.full((batch,), k, dtype=torch.int32, device=device), verification="token")

    def op():
        return backend().chain_speculative_sampling_from_logits(ids, target, rows, **op_kwargs)

    def whole():
        return shim.rejection_sample(*args)

    sampled, num_sampled = whole()
    out = op()  # the same work: the op on the pre-gathered rows gives the shim's tokens
    assert torch.equal(num_sampled, out.num_accepted + 1) and torch.equal(sampled, out.output_token_ids.long())
    warmup = 1 if batch * k * vocab > 10**7 else 5  # large rows: one call warms the caches and the allocator
    gather_us = median_us(gather, device, repeats, warmup)
    op_us = median_us(op, device, repeats, warmup)
    shim_us = median_us(whole, device, repeats, warmup)
    return {"B": batch, "k": k, "V": vocab, "gather_us": gather_us, "op_us": op_us, "shim_us": shim_us,
            "gather_vs_op": gather_us / op_us}


def main(args) -> int:
    device = choose_device(args.device)
    rows = []
    for vocab in args.vocab:
        for batch in args.batch:
            for k in args.k:
                case = make_case(batch, k, vocab, device, torch.Generator().manual_seed(batch * 1000 + k + vocab))
                rows.append(measure(case, batch, k, vocab, device, args.repeats))
                print_row(rows[-1])
                del case
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"vLLM Model Runner V2 rejection_sample: the shim's draft-logits gather ([B k, V] float32 copy) vs the op "
           f"on pre-gathered rows vs the whole shim call on {name} (float32 cache, median of {args.repeats})", rows,
           ["B", "k", "V", "gather_us", "op_us", "shim_us", "gather_vs_op"])
    save(args, {"title": f"vLLM V2 rejection_sample shim: draft-logits gather vs op, {name}", "device": name}, rows,
         ["B", "k", "V"])
    return 0

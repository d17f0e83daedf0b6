"""vLLM v1's rejection_sample through the shim against a PyTorch formulation of vLLM's rejection sampling.

vLLM v1's rejection_sample as the shim specdec_ext.compat.vllm runs it (our chain sampling kernel, flat layout,
uniforms drawn on the device) against a readable vectorised PyTorch formulation of vLLM's rejection sampling, with
and without draft probabilities (n-gram / EAGLE point proposals). Every request has k drafts; all rows are sampled
(no greedy request)."""
import types

import torch

from ..compat import vllm as shim
from ..factory import choose_device
from .common import add_common_arguments, int_list, median_us, print_row, report, save


def add_arguments(parser) -> None:
    # The CPU default grid stays under two minutes on a small machine; B = 64 there: --batch 64.
    parser.add_argument("--batch", type=int_list, default=None,
                        help="batch sizes B (default 1,8,32 on the CPU, 1,8,64 on a GPU)")
    parser.add_argument("--k", type=int_list, default=None,
                        help="draft tokens per request k (default 1,8 on the CPU, 1,4,8 on a GPU)")
    parser.add_argument("--vocab", type=int_list, default=[32000, 128256],
                        help="vocabulary sizes V (default 32000,128256)")
    add_common_arguments(parser)


def torch_rejection_sample(draft_token_ids, counts, max_spec_len, cu_num_draft_tokens, draft_probs, target_probs,
                           bonus_token_ids, uniforms, exponentials):
    """vLLM's rejection sampling in plain PyTorch: draft t is accepted where u_t * q_t(x) < p_t(x) (q = 1 for point
    proposals); the first rejected position emits a recovered token, the argmax of max(p - q, 0) / E over the vocabulary
    (an exponential race: a draw from the normalised residual; for point proposals p with the draft zeroed), E one
    [V] row of exponentials per request; all accepted: the bonus token.
    Returns [B, max_spec_len + 1] int32, -1 padded."""
    batch, device = len(counts), target_probs.device
    count = torch.tensor(counts, device=device)
    rows = torch.arange(draft_token_ids.numel(), device=device)
    ids = draft_token_ids.long()
    p = target_probs[rows, ids]
    if draft_probs is None:
        q = torch.ones_like(p)
        residual = target_probs.scatter(1, ids.unsqueeze(1), 0.0)
    else:
        q = draft_probs[rows, ids]
        residual = (target_probs - draft_probs).clamp_min_(0.0)
    accepted = uniforms * q < p
    request = torch.repeat_interleave(torch.arange(batch, device=device), count, output_size=ids.numel())
    recovered = (residual / exponentials[request]).argmax(-1)
    # Padded [B, K] views of the flat per-token results (positions past a request's count never count).
    pos = torch.arange(max_spec_len, device=device)
    valid = pos < count.unsqueeze(1)
    index = ((cu_num_draft_tokens.long() - count).unsqueeze(1) + pos).clamp(0, max(ids.numel() - 1, 0))
    def gathered(flat, fill):
        return torch.where(valid, flat[index], fill) if ids.numel() else \
            torch.full((batch, max_spec_len), fill, device=device)
    num_accepted = gathered(accepted, False).int().cumprod(1).sum(1)
    drafts, recovered = gathered(ids, -1), gathered(recovered, -1)
    out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32, device=device)
    out[:, :max_spec_len] = torch.where(pos < num_accepted.unsqueeze(1), drafts, -1).int()
    at_stop = recovered.gather(1, num_accepted.clamp(max=max(max_spec_len - 1, 0)).unsqueeze(1)) if max_spec_len \
        else bonus_token_ids.long()
    last = torch.where((num_accepted < count).unsqueeze(1), at_stop, bonus_token_ids.long().view(-1, 1))
    return out.scatter_(1, num_accepted.long().unsqueeze(1), last.int())


def make_case(batch, k, vocab, device, gen):
    """A flat batch of k drafts per request, drafts drawn from draft distributions near the target's."""
    tokens = batch * k
    target_logits = torch.randn(tokens, vocab, generator=gen) * 3.0
    draft_probs = torch.softmax(target_logits + torch.randn(tokens, vocab, generator=gen), -1)
    ids = torch.multinomial(draft_probs, 1, generator=gen).view(-1).int()
    cu = torch.arange(1, batch + 1, dtype=torch.int32).mul(k)
    return {"ids": ids.to(device), "counts": [k] * batch, "cu": cu.to(device),
            "target": torch.softmax(target_logits, -1).to(device), "draft": draft_probs.to(device),
            "bonus": torch.randint(0, vocab, (batch, 1), generator=gen, dtype=torch.int32).to(device)}


def main(args) -> int:
    device = choose_device(args.device)
    cuda = device.type == "cuda"
    batches = args.batch or ([1, 8, 64] if cuda else [1, 8, 32])
    ks = args.k or ([1, 4, 8] if cuda else [1, 8])
    repeats = args.repeats
    rows = []
    for vocab in args.vocab:
        for batch in batches:
            for k in ks:
                case = make_case(batch, k, vocab, device, torch.Generator().manual_seed(batch * 1000 + k + vocab))
                for with_draft in (True, False):
                    rows.append(measure(case, batch, k, vocab, with_draft, device, repeats))
                    print_row(rows[-1])
    name = torch.cuda.get_device_name() if cuda else "CPU"
    report(f"vLLM rejection_sample: specdec_ext shim vs PyTorch formulation of vLLM's rejection sampling on {name} "
           f"(float32, every request k drafts, median of {repeats})", rows,
           ["draft", "B", "k", "V", "ours_us", "torch_us", "speedup"])
    save(args, {"title": f"vLLM rejection_sample shim vs PyTorch, {name}", "device": name}, rows,
         ["draft", "B", "k", "V"])
    return 0


def measure(case, batch, k, vocab, with_draft, device, repeats):
    draft = case["draft"] if with_draft else None
    meta = types.SimpleNamespace(all_greedy=False, all_random=True, generators={},
                                 temperature=torch.ones(batch, device=device))
    args = (case["ids"], case["counts"], k, case["cu"], draft, case["target"], case["bonus"])
    def ours():
        return shim.rejection_sample(*args, meta)

    def baseline():  # its randomness drawn inside, as the shim's is
        uniforms = torch.rand(batch * k, device=device)
        exponentials = torch.empty(batch, vocab, device=device).exponential_()
        return torch_rejection_sample(*args, uniforms, exponentials)

    a, b = ours(), baseline()
    assert a.shape == b.shape == (batch, k + 1)
    warmup = 1 if batch * k * vocab > 10**7 else 5  # large rows: one call warms the caches and the allocator
    ours_us = median_us(ours, device, repeats, warmup)
    torch_us = median_us(baseline, device, repeats, warmup)
    return {"draft": "probs" if with_draft else "none", "B": batch, "k": k, "V": vocab, "ours_us": ours_us,
            "torch_us": torch_us, "speedup": torch_us / ours_us}

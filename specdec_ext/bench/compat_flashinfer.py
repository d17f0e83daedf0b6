"""FlashInfer's chain_speculative_sampling through the shim against the same call in PyTorch.

FlashInfer's chain_speculative_sampling through specdec_ext's shim against the same call written in PyTorch,
vectorised, as an engine without a fused kernel would write it (FlashInfer's semantics: probabilities in, output ids
with -1 padding, accepted and emitted counts added into the caller's buffers).
"""
import torch

from ..compat.flashinfer import sampling
from ..factory import choose_device
from .common import add_common_arguments, int_list, median_us, print_row, report, save


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=None,
                        help="batch sizes B (default 1,64 on the CPU, 1,8,64 on a GPU)")
    parser.add_argument("--k", type=int_list, default=None,
                        help="draft tokens per request k (default 1,8 on the CPU, 1,4,8 on a GPU)")
    parser.add_argument("--vocab", type=int_list, default=[32000, 128256],
                        help="vocabulary sizes V (default 32000,128256)")
    add_common_arguments(parser)


def torch_chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, accepted, emitted, generator=None):
    """FlashInfer's chain speculative sampling in PyTorch: each draft passes when u * q(x) < p(x); the emitted drafts
    are those before the first failure; the next token is drawn from max(0, p - q) at that position (p itself when
    that is all zero, and at the bonus position). Counts are added into `accepted` / `emitted`."""
    batch, k, vocab = draft_probs.shape
    ids = draft_token_ids.long()
    p = target_probs[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    q = draft_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    passes = torch.rand(batch, k, generator=generator, device=p.device) * q < p
    num_emitted = passes.int().cumprod(-1).sum(-1)  # drafts before the first failure
    rows = torch.arange(batch, device=p.device)
    p_next = target_probs[rows, num_emitted].float()
    q_next = torch.where((num_emitted < k).unsqueeze(-1), draft_probs[rows, num_emitted.clamp_max(k - 1)].float(), 0.0)
    residual = (p_next - q_next).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    token = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    out = torch.where(torch.arange(k + 1, device=p.device) < num_emitted.unsqueeze(-1),
                      torch.nn.functional.pad(ids, (0, 1)), -1)
    out[rows, num_emitted] = token
    accepted += passes.sum(-1).to(accepted.dtype)
    emitted += num_emitted.to(emitted.dtype)
    return out.int(), accepted, emitted


def make_case(batch, k, vocab, device, gen):
    draft_logits = torch.randn(batch, k, vocab, generator=gen) * 2.5
    target_logits = torch.cat([draft_logits, torch.randn(batch, 1, vocab, generator=gen) * 2.5], 1)
    target_logits += torch.randn(batch, k + 1, vocab, generator=gen)  # a draft close to, not equal to, the target
    draft, target = torch.softmax(draft_logits, -1), torch.softmax(target_logits, -1)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, k).int()
    return draft.to(device), ids.to(device), target.to(device)


def main(args) -> int:
    device = choose_device(args.device)
    big = device.type == "cuda"
    batches = args.batch or ([1, 8, 64] if big else [1, 64])
    ks = args.k or ([1, 4, 8] if big else [1, 8])
    rows = []
    for vocab in args.vocab:
        for batch in batches:
            for k in ks:
                gen = torch.Generator().manual_seed(batch * k + vocab)
                draft, ids, target = make_case(batch, k, vocab, device, gen)
                seed = torch.randint(0, 2**62, (batch,), device=device)
                offset = torch.zeros(batch, dtype=torch.int64, device=device)
                counts = [torch.zeros(batch, dtype=torch.int32, device=device) for _ in range(4)]
                def ours():
                    return sampling.chain_speculative_sampling(draft, ids, target, counts[0], counts[1], seed=seed,
                                                                                   offset=offset)
                torch_gen = torch.Generator(device=device).manual_seed(0)
                def baseline():
                    return torch_chain_speculative_sampling(draft, ids, target, counts[2], counts[3], torch_gen)
                # Interleaved medians, so that both see the same machine state.
                ours_us, torch_us = [], []
                for _ in range(3):
                    ours_us.append(median_us(ours, device, max(3, args.repeats // 3)))
                    torch_us.append(median_us(baseline, device, max(3, args.repeats // 3)))
                row = {"B": batch, "k": k, "V": vocab, "shim_us": sorted(ours_us)[1], "torch_us": sorted(torch_us)[1]}
                row["speedup"] = row["torch_us"] / row["shim_us"]
                rows.append(row)
                print_row(row)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"FlashInfer chain_speculative_sampling: specdec_ext shim vs PyTorch, float32 probabilities, on {name}",
           rows, ["B", "k", "V", "shim_us", "torch_us", "speedup"])
    save(args, {"title": f"FlashInfer shim vs PyTorch chain sampling, {name}", "device": name}, rows, ["B", "k", "V"])
    return 0

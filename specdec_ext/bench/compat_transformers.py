"""transformers' assisted-sampling verification through the shim against transformers' _speculative_sampling.

The transformers shim's verification (specdec_ext.compat.transformers, our from-logits kernel) against transformers'
own `_speculative_sampling` on the same inputs, at the shapes assisted decoding hands over: batch 1 (the only batch
assisted decoding runs), candidate_length k, float32 processed logits [1, k, V] and [1, k + 1, V]. Both include the
host read of the accepted count that transformers' loop needs.
"""
import torch

from ..factory import choose_device
from .common import add_common_arguments, int_list, median_us, print_row, report, save


def add_arguments(parser) -> None:
    parser.add_argument("--k", type=int_list, default=[1, 4, 8], help="candidate tokens k (default 1,4,8)")
    parser.add_argument("--vocab", type=int_list, default=[32000, 49152, 128256],
                        help="vocabulary sizes V (default 32000,49152,128256)")
    add_common_arguments(parser)


def make_round(k, vocab, device, gen):
    """One round: a 16-token prefix and k candidates sampled from the assistant's rows, the assistant's rows
    [1, k, V] (the target's plus noise: acceptance well inside (0, 1)) and the target's [1, k + 1, V]."""
    target = torch.randn(1, k + 1, vocab, generator=gen) * 2.5
    draft = target[:, :k] + 0.8 * torch.randn(1, k, vocab, generator=gen)
    candidates = torch.multinomial(draft[0].softmax(-1), 1, generator=gen).view(1, k)
    prefix = torch.randint(vocab, (1, 16), generator=gen)
    return (torch.cat([prefix, candidates], 1).to(device), draft.to(device), k, target.to(device))


def main(args) -> int:
    from transformers.generation.utils import _speculative_sampling

    from ..compat.transformers import speculative_sampling

    device = choose_device(args.device)
    rows = []
    for vocab in args.vocab:
        for k in args.k:
            inputs = make_round(k, vocab, device, torch.Generator().manual_seed(k * 100003 + vocab))
            ours = median_us(lambda: speculative_sampling(*inputs), device, args.repeats)
            theirs = median_us(lambda: _speculative_sampling(*inputs), device, args.repeats)
            rows.append({"k": k, "V": vocab, "ours_us": ours, "transformers_us": theirs, "speedup": theirs / ours})
            print_row(rows[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"transformers assisted-sampling verification, batch 1, float32 logits, on {name}: the shim (ours) vs "
           "transformers' _speculative_sampling", rows, ["k", "V", "ours_us", "transformers_us", "speedup"])
    save(args, {"title": f"transformers shim vs _speculative_sampling, {name}", "device": name}, rows, ["k", "V"])
    return 0

"""chain_speculative_sampling_from_logits with top-k / top-p fused in, against Python masks and then the op.

The masks as the decoder applied them before (sort-based masks over every row in float32:
reference.filter_logits(dtype=float32)), then the same op on the masked rows. Both process the target rows
[B, K+1, V] and draft rows [B, K, V] of a round at T = 0.7; the fused op processes only the rows it reads (up to the
first rejection) and sorts nothing (row_filter.h). bytes: what the fused op must read at least (chain_sampling's count),
floor_us their time at the copy bandwidth measured in the run, of_copy_bw = floor_us / graph_us (the fused op replayed
from a CUDA graph on a GPU); grid: the CUDA launch, blocks x threads (an H200's when run on the CPU)."""
import torch

import specdec_ext
from specdec_ext import reference

from ..factory import choose_device
from .chain_sampling import bytes_read, graph_replay_us, make_case
from .common import (
    add_common_arguments,
    copy_bandwidth_gbs,
    int_list,
    median_us,
    print_row,
    report,
    sampling_grid,
    save,
)

CONTROLS = {"top-p 0.9": (0, 0.9), "top-k 50, top-p 0.9": (50, 0.9)}
TEMPERATURE = 0.7


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[8, 64], help="batch sizes B (default 8,64)")
    parser.add_argument("--k", type=int_list, default=[4], help="draft tokens per request K (default 4)")
    parser.add_argument("--vocab", type=int_list, default=[49152, 128256],
                        help="vocabulary sizes V (default 49152,128256)")
    add_common_arguments(parser)


def measure(case, controls, batch, k, vocab, device, repeats, peak):
    top_k, top_p = CONTROLS[controls]
    ids, seed, tl, dl = case["ids"], case["seed"], case["target_logits"], case["draft_logits"]
    t = torch.full((batch,), TEMPERATURE, device=device)
    kk = torch.full((batch,), top_k, dtype=torch.int32, device=device)
    pp = torch.full((batch,), top_p, device=device)

    def fused():
        return specdec_ext.chain_speculative_sampling_from_logits(ids, tl, dl, temperature=t, seed=seed, top_k=kk,
                                                                  top_p=pp)

    def masked():
        mt = reference.filter_logits(tl, t, kk, pp, dtype=torch.float32)
        md = reference.filter_logits(dl, t, kk, pp, dtype=torch.float32)
        return specdec_ext.chain_speculative_sampling_from_logits(ids, mt, md, temperature=t, seed=seed)

    plain = lambda: specdec_ext.chain_speculative_sampling_from_logits(ids, tl, dl, temperature=t, seed=seed)  # noqa
    fused_us = median_us(fused, device, repeats)
    masked_us = median_us(masked, device, max(3, repeats // 5), warmup=1)
    plain_us = median_us(plain, device, repeats)
    out = fused()
    graph_us = graph_replay_us(fused, device, repeats) if device.type == "cuda" else fused_us
    nbytes = bytes_read(out, k, vocab, tl.element_size(), True)
    floor_us = nbytes / (peak * 1e9) * 1e6
    return {"controls": controls, "B": batch, "K": k, "V": vocab, "accepted": float(out.num_accepted.float().mean()),
            "fused_us": fused_us, "masks_then_op_us": masked_us, "speedup": masked_us / fused_us,
            "unprocessed_op_us": plain_us, "processing_cost": fused_us / plain_us, "graph_us": graph_us,
            "bytes": nbytes, "floor_us": floor_us, "of_copy_bw": floor_us / graph_us,
            "grid": sampling_grid(batch, device)}


def main(args) -> int:
    device = choose_device(args.device)
    peak = copy_bandwidth_gbs(device)
    rows = []
    for vocab in args.vocab:
        for batch in args.batch:
            for k in args.k:
                case = make_case(batch, k, vocab, torch.float32, device, torch.Generator().manual_seed(batch + vocab))
                for controls in CONTROLS:
                    rows.append(measure(case, controls, batch, k, vocab, device, args.repeats, peak))
                    print_row(rows[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    columns = ["controls", "B", "K", "V", "accepted", "fused_us", "masks_then_op_us", "speedup", "unprocessed_op_us",
               "processing_cost", "graph_us", "bytes", "floor_us", "of_copy_bw", "grid"]
    report(f"top-k / top-p fused into chain sampling from logits vs Python masks + the op, T = {TEMPERATURE}, on "
           f"{name} (copy bandwidth {peak:.0f} GB/s)", rows, columns)
    save(args, {"title": f"fused top-k / top-p, {name}", "device": name, "copy_bw_gbs": peak}, rows,
         ["controls", "B", "K", "V"])
    return 0

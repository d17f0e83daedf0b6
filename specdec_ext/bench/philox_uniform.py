"""philox_uniform against the vectorised PyTorch reference.

The op writes 4 bytes per uniform and reads 16 per request, so it is a streaming write: GB/s of output against the
copy bandwidth."""
import torch

import specdec_ext
from specdec_ext import reference

from ..factory import choose_device
from .common import add_common_arguments, copy_bandwidth_gbs, int_list, median_us, report, save


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[1, 8, 64], help="batch sizes B (default 1,8,64)")
    parser.add_argument("--uniforms", type=int_list, default=None,
                        help="uniforms per request n (default 4096,131072 on the CPU, 131072,4194304 on a GPU)")
    add_common_arguments(parser)


def main(args) -> int:
    device = choose_device(args.device)
    peak = copy_bandwidth_gbs(device)
    rows = []
    uniforms = args.uniforms or ([4096, 131072] if device.type == "cpu" else [131072, 1 << 22])
    for batch in args.batch:
        for n in uniforms:
            seed = torch.randint(-(2**62), 2**62, (batch,), device=device)
            offset = torch.randint(0, 2**40, (batch,), device=device)
            ours = median_us(lambda: specdec_ext.philox_uniform(seed, offset, n), device, args.repeats)
            ref = median_us(lambda: reference.philox_uniform(seed, offset, n), device, max(5, args.repeats // 5))
            gbs = batch * n * 4 / (ours * 1e-6) / 1e9
            rows.append({"B": batch, "n": n, "ours_us": ours, "reference_us": ref, "speedup": ref / ours,
                         "GB/s": gbs, "of_copy_bw": gbs / peak})
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"philox_uniform on {name} (copy bandwidth {peak:.0f} GB/s)", rows,
           ["B", "n", "ours_us", "reference_us", "speedup", "GB/s", "of_copy_bw"])
    save(args, {"title": f"philox_uniform, {name}", "device": name, "copy_bw_gbs": peak}, rows, ["B", "n"])
    return 0

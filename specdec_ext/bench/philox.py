"""`specdec bench philox`: philox_uniform against the vectorised PyTorch reference. The op writes 4 bytes per
uniform and reads 16 per request, so it is a streaming write: GB/s of output against the copy bandwidth."""
import torch

import specdec_ext
from specdec_ext import reference

from ..factory import choose_device
from .common import copy_bandwidth_gbs, median_us, report, save


def main(args) -> int:
    device = choose_device(args.device)
    peak = copy_bandwidth_gbs(device)
    rows = []
    for batch in (1, 8, 64):
        for n in (4096, 131072) if device.type == "cpu" else (131072, 1 << 22):
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

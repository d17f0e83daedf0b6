"""quantized_linear (GGUF blocks decoded in registers) against dequantised weights and F.linear.

ops.quantized_linear (weights kept as GGUF blocks) against what an engine would otherwise run: the same weights
dequantised once to the activations' dtype and F.linear (MKL on the CPU, cuBLAS on a GPU), which reads 4-8x the bytes
a step. The shipped model's projection shapes, Q4_1 and Q8_0 (its file's formats) and Q4_K / Q6_K, 1-64 rows; weight
bytes read per second against the measured copy bandwidth."""
import torch
import torch.nn.functional as F

from specdec_ext import ops

from ..factory import choose_device
from .common import add_common_arguments, copy_bandwidth_gbs, int_list, median_us, report, save
from .cpu_forward import SHAPES, random_blocks

FORMATS = {"Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


def add_arguments(parser) -> None:
    parser.add_argument("--rows", type=int_list, default=[1, 4, 16, 64],
                        help="activation rows M, the tokens of a step (default 1,4,16,64)")
    add_common_arguments(parser)


def main(args) -> int:
    device = choose_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth_gbs(device) / 2  # bytes read per second (a copy reads and writes)
    print(f"{device}, activations {dtype}, read bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        for fmt_name, fmt in FORMATS.items():
            if k % ops.QUANTIZED_FORMATS[fmt][0]:
                continue  # the K-quants' 256-weight super-blocks do not tile 576 columns (GGUF files use Q8_0/Q4_1)
            blocks = random_blocks(fmt, n, k).to(device)
            dense = ops.dequantize(blocks, fmt).to(dtype)
            for m in args.rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                ours = median_us(lambda: ops.quantized_linear(x, blocks, fmt), device, args.repeats)
                ref = median_us(lambda: F.linear(x, dense), device, args.repeats)
                rows.append({"shape": f"{name} {n}x{k}", "format": fmt_name, "M": m, "ours_us": ours,
                             "dequantised_linear_us": ref, "speedup": ref / ours,
                             "weight_gbs": blocks.numel() / (ours * 1e-6) / 1e9,
                             "of_bandwidth": blocks.numel() / (ours * 1e-6) / 1e9 / bandwidth})
    report(f"quantized_linear vs dequantised weights + F.linear ({device}, {dtype})", rows,
           ["shape", "format", "M", "ours_us", "dequantised_linear_us", "speedup", "weight_gbs", "of_bandwidth"])
    save(args, {"title": "quantized_linear", "device": str(device), "read_bw_gbs": bandwidth}, rows,
         ["shape", "format", "M"])
    return 0

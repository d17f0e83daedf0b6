"""What every benchmark shares: its common flags, timing (median of repeats after warm-up, in one run, ours against
the reference), bandwidth against the device's measured copy bandwidth, and reporting."""
import argparse
import json
import statistics
import time

import torch


def add_common_arguments(parser: argparse.ArgumentParser, *, repeats: int = 50, cpu_only: bool = False,
                         plot: bool = True) -> None:
    """--device, --repeats, --json and --plot. cpu_only: a benchmark of the CPU path (--device takes cpu only);
    plot: whether its rows have the `speedup` that --plot draws."""
    if cpu_only:
        parser.add_argument("--device", default=None, choices=["cpu"], help="cpu (the only device it runs on)")
    else:
        parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"timed repeats after warm-up, the median reported (default {repeats})")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    if plot:
        parser.add_argument("--plot", default=None, help="write a bar chart of the speed-ups to this PNG file")


def int_list(text: str) -> list[int]:
    """argparse type of a comma-separated list of positive integers, e.g. --batch 1,8,64."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def print_row(row: dict) -> None:
    """One result row as key=value pairs, printed as soon as it is measured."""
    print(" ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}" for key, val in row.items()),
          flush=True)


def elapsed_us(fn, device: torch.device) -> float:
    """Wall time of one call of fn in microseconds: CUDA events on a GPU, perf_counter on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def median_us(fn, device: torch.device, repeats: int = 50, warmup: int = 5) -> float:
    """Median wall time of fn() in microseconds (elapsed_us) over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(elapsed_us(fn, device) for _ in range(repeats))


def cuda_graph(fn):
    """A CUDA graph of fn, captured after one warm-up run on a side stream: its replay runs fn's kernels without
    Python's launch overhead (what the decoder's rounds replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written): the ceiling bandwidth is quoted against."""
    if device.type != "cuda":
        nbytes = 1 << 28
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), device, repeats=repeats, warmup=3)
    return 2 * nbytes / (us * 1e-6) / 1e9


# An H200's multiprocessors: the device the grid column describes when the benchmark runs on the CPU.
H200_MULTIPROCESSORS = 132


def import_flashinfer(wanted: bool):
    """The flashinfer package when --against flashinfer asks for it and it imports, else None (the reason printed)."""
    if not wanted:
        return None
    try:
        import flashinfer
        import flashinfer.sampling  # noqa: F401 (the kernels the sampling benches time)
    except Exception as error:  # an absent package, or one whose JIT or native parts fail here
        print(f"--against flashinfer: flashinfer does not import here ({type(error).__name__}: "
              f"{str(error)[:120]}); no FlashInfer column", flush=True)
        return None
    print(f"--against flashinfer: flashinfer {getattr(flashinfer, '__version__', '?')}", flush=True)
    return flashinfer


def sampling_grid(batch: int, device: torch.device) -> str:
    """The CUDA sampling kernels' launch at `batch` requests, "blocks x threads" (a request's 1024 lanes over the
    blocks the launcher picks): on the device's multiprocessors, or an H200's when the benchmark runs on the CPU."""
    from ..ops import _C

    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else H200_MULTIPROCESSORS
    per_request, blocks = _C.sampling_grid(batch, sms)
    return f"{blocks}x{1024 // per_request}"


def report(title: str, rows: list[dict], columns: list[str]) -> None:
    print(title)
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def save(args, meta: dict, rows: list[dict], label_keys: list[str]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if getattr(args, "plot", None):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [" ".join(str(r[k]) for k in label_keys) for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.5), 4))
        ax.bar(range(len(rows)), [r["speedup"] for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("speed-up of ours over the PyTorch baseline")
        ax.set_title(meta.get("title", ""))
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")

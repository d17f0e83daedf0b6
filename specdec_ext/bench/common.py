"""Timing and reporting shared by every microbenchmark: median of repeats after warm-up, in one run, ours
against the reference; bandwidth against the device's measured copy bandwidth."""
import json
import statistics
import time

import torch


def median_us(fn, device: torch.device, repeats: int = 50, warmup: int = 5) -> float:
    """Median wall time of fn() in microseconds: CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written): the ceiling bandwidth is quoted against."""
    if device.type != "cuda":
        nbytes = 1 << 28
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), device, repeats=repeats, warmup=3)
    return 2 * nbytes / (us * 1e-6) / 1e9


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
    if args.plot:
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

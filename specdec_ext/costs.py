"""The measured costs that adaptive k and adaptive tree sizes weigh: seconds of a model's forward over R rows
(batch x Q new tokens), at a few row counts R, interpolated between them.

A table is measured once per model, dtype, device, thread count and build, on the row counts a run can use,
and kept in a file under the user's cache directory ($SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec_ext, else
~/.cache/specdec_ext), so that a second run pays nothing and chooses the same k. Live timings would make k, and
with it the sampled tokens, depend on the machine's load; a fixed table makes a run reproducible per seed.
"""
import dataclasses
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from ._version import __version__

# Around the CPU GEMM's 8-row passes and 16-row path; past 64, the widest tree blocks of a batch.
ROW_POINTS = (1, 2, 4, 8, 9, 12, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def interpolate(points: dict, x: float) -> float:
    """Piecewise linear through {x: y} points; flat below the first (and for one point), extended with the last
    slope above the last."""
    xs = sorted(points)
    if x <= xs[0] or len(xs) == 1:
        return points[xs[0]]
    hi = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    x0, x1 = xs[hi - 1], xs[hi]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def row_points(max_rows: int) -> list:
    """The row counts measured for runs of up to max_rows rows: ROW_POINTS below it, and max_rows itself."""
    return sorted({r for r in ROW_POINTS if r < max_rows} | {max(1, max_rows)})


def cache_dir() -> Path:
    base = os.environ.get("SPECDEC_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec_ext"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def table_key(model) -> dict:
    """What a forward's cost depends on: the model's shape and dtype, the device, the threads and the build."""
    from . import build_info

    info = build_info()
    return {"config": dataclasses.asdict(model.config), "dtype": str(model.dtype), "device": _device_name(model.device),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "specdec_ext": __version__,
            "build": {k: info.get(k) for k in ("compiler", "cpu_features_compiled", "cuda_archs", "openmp")}}


def _table_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "costs" / f"{digest}.json"


def forward_seconds(model, rows: int, repeats: int = 3) -> float:
    """Median seconds of one forward of Q = rows new tokens at batch 1 (after a warm-up), on a scratch cache."""
    cache = model.new_kv_cache(1, rows + 1)
    ids = torch.zeros(1, rows, dtype=torch.long, device=model.device)
    indices = torch.arange(rows, device=model.device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, cache, logits_indices=indices)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def forward_costs(model, max_rows: int, *, use_file: bool = True) -> dict:
    """{rows: seconds} of `model`'s forward at row_points(max_rows): read from the cache file where it has them,
    measured (and added to the file) where it does not."""
    key = table_key(model)
    path = _table_file(key)
    table = {}
    if use_file:
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") == json.loads(json.dumps(key, default=str)):
                table = {int(r): float(s) for r, s in saved["seconds"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            table = {}  # no file yet, or one from another version: measure
    missing = [r for r in row_points(max_rows) if r not in table]
    for r in missing:
        table[r] = forward_seconds(model, r)
    if missing and use_file:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "seconds": table}, default=str, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache directory: the table is measured again next time
    return {r: table[r] for r in row_points(max_rows)}


def draft_cost_model(drafter):
    """What a draft step of `drafter` is measured on: its draft model, or an EAGLE head's one-layer decoder (the
    head's step but for its feature fusion); None for drafters whose steps cost next to nothing (n-gram lookup,
    Medusa heads on the target's hidden state)."""
    head = getattr(drafter, "head", None)
    return getattr(drafter, "model", None) or getattr(head, "decoder", None)


class CostModel:
    """Seconds of a target forward over R rows and of a draft model's forward over R rows, at measured points R
    (interpolated between), for the adaptive choice of k: on a CPU a verify block's cost jumps where its rows need
    another pass over the weights, and on any device it grows with the batch. draft: None for drafters whose cost
    is not a forward (n-gram lookup: ~0)."""

    def __init__(self, verify: dict, draft: dict | None = None):
        if not verify or any(r < 1 or t < 0 for r, t in verify.items()):
            raise ValueError("CostModel: verify must map row counts >= 1 to seconds >= 0")
        self.verify, self.draft = dict(verify), dict(draft or {})

    @classmethod
    def measure(cls, target, draft_model, max_rows: int, max_draft_rows: int, *, use_file: bool = True) -> "CostModel":
        """The tables of target and draft model up to max_rows / max_draft_rows rows (see forward_costs)."""
        verify = forward_costs(target, max_rows, use_file=use_file)
        draft = forward_costs(draft_model, max_draft_rows, use_file=use_file) if draft_model is not None else None
        return cls(verify, draft)

    def covers(self, max_rows: int, max_draft_rows: int, has_draft: bool) -> bool:
        """Whether the tables reach the row counts a run can ask for."""
        return max(self.verify) >= max_rows and (not has_draft or (bool(self.draft) and max(self.draft) >= max_draft_rows))

    def verify_cost(self, rows: int) -> float:
        return interpolate(self.verify, rows)

    def draft_cost(self, rows: int) -> float:
        return interpolate(self.draft, rows) if self.draft else 0.0

    def best_k(self, alphas, k_max: int) -> int:
        """argmax over k in [0, k_max] of a round's expected tokens over its cost, for requests of acceptance
        estimates `alphas` (a list, one per request, or one float: a batch of 1) all drafting k (Leviathan et
        al.: (1 - alpha^(k+1)) / (1 - alpha) tokens each for k draft steps over B rows and a verify block of
        B x (k + 1) rows)."""
        alphas = [min(a, 0.999) for a in (alphas if isinstance(alphas, (list, tuple)) else [alphas])]
        batch = len(alphas)
        cost = lambda k: k * self.draft_cost(batch) + self.verify_cost(batch * (k + 1))
        tokens = lambda k: sum((1 - a ** (k + 1)) / (1 - a) for a in alphas)
        return max(range(k_max + 1), key=lambda k: tokens(k) / cost(k))

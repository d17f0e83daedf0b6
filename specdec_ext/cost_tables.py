"""The measured costs of adaptive k (specdec_ext.engine.policy): seconds of the target's forward over R rows (batch x
Q new tokens) and of one draft step over R rows (what the drafter's cost_probe runs: a draft model's or head's
forward, Medusa's heads, an n-gram lookup), at a few row counts R.

A table is measured once per model (or drafter), dtype, device, thread count and build, on the row counts a run can
use, and kept in a file under the user's cache directory ($SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec_ext, else
~/.cache/specdec_ext), so that a second run pays nothing and chooses the same k. Live timings would make k, and with
it the sampled tokens, depend on the machine's load; a fixed table makes a run reproducible per seed.

A layer below both engine/ (the policy reads the tables) and drafters/ (their cost probes time a step and name it
with table_key): it imports neither (tests/test_import_graph.py).
"""
import dataclasses
import hashlib
import json
import math
import numbers
import os
import platform
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from . import _extension
from ._version import __version__

# Around the CPU GEMM's 8-row passes and 16-row path; past 64, the widest tree blocks of a batch.
ROW_POINTS = (1, 2, 4, 8, 9, 12, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


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


def environment(device: torch.device) -> dict:
    """What any step's cost depends on besides its own shape: the device, the threads and the build."""
    info = _extension.load("_C").build_info()  # specdec_ext.build_info(): the package's __init__ is a layer above
    return {"device": _device_name(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "specdec_ext": __version__,
            "build": {k: info.get(k) for k in ("compiler", "cpu_features_compiled", "cuda_archs", "openmp")}}


def table_key(model) -> dict:
    """What a forward's cost depends on: the model's shape and dtype, the formats of the weights it keeps as GGUF
    blocks and how they multiply (activations), the CPU kernels' instruction set, and the environment."""
    from .models.quantized import FORMAT_NAMES  # models import this module's users; not at import time

    kept = model.quantized_weights() if hasattr(model, "quantized_weights") else []
    formats = sorted({FORMAT_NAMES[p.format] for w in kept for p in getattr(w, "parts", [w])})
    weights = {"kept": formats, "activations": model.activations} if kept else None
    isa = _extension.load("_C").cpu_isa() if model.device.type == "cpu" else None
    return {"config": dataclasses.asdict(model.config), "dtype": str(model.dtype), "weights": weights, "isa": isa,
            **environment(model.device)}


def _table_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "costs" / f"{digest}.json"


def step_seconds(step, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of step() over `repeats` runs after a warm-up."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def forward_step(model, rows: int):
    """One forward of Q = rows new tokens at batch 1 on a scratch cache, as a function of nothing."""
    cache = model.new_kv_cache(1, rows + 1)
    ids = torch.zeros(1, rows, dtype=torch.long, device=model.device)
    indices = torch.arange(rows, device=model.device)
    return lambda: model(ids, cache, logits_indices=indices)


def forward_seconds(model, rows: int) -> float:
    return step_seconds(forward_step(model, rows), model.device)


def seconds_table(table, *, zero_ok: bool) -> dict | None:
    """table as {int rows: float seconds} when it maps row counts >= 1 to finite seconds > 0 (>= 0 with
    zero_ok), else None: a NaN would make every tokens-over-cost comparison false (k = 0 every round), a negative or
    zero cost a free round."""
    if not isinstance(table, Mapping):
        return None
    for r, s in table.items():
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1 or isinstance(s, bool) or \
                not isinstance(s, numbers.Real) or not math.isfinite(s) or not (s > 0 or zero_ok and s == 0):
            return None
    return {int(r): float(s) for r, s in table.items()}


def _read_table(path: Path, key: dict) -> dict:
    """The {rows: seconds} saved for `key` at path; {} (measure again) where there is none, or it is another
    version's, or it does not pass seconds_table (a hand edit, a truncated write, a timer's zero)."""
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or saved.get("key") != json.loads(json.dumps(key, default=str)):
            return {}
        rows = saved["seconds"]
        if not isinstance(rows, dict) or not all(r.isascii() and r.isdigit() for r in rows):
            return {}
        return seconds_table({int(r): s for r, s in rows.items()}, zero_ok=False) or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}


def _write_table(path: Path, key: dict, table: dict) -> None:
    """Replaces the file at path by the table, through a temp file that a failed write removes; a file that cannot
    be written (a read-only cache, a directory at its path) is warned of: the table is measured again next run."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "seconds": table}, default=str, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        warnings.warn(f"specdec_ext: cannot write the cost table cache {path} ({e}); it is measured again next run",
                      RuntimeWarning, stacklevel=3)


def cost_table(key: dict, seconds_of, max_rows: int, *, use_file: bool = True) -> dict:
    """{rows: seconds} at row_points(max_rows) of the step that `key` names: read from its cache file where it has
    them, measured by seconds_of(rows) (and added to the file) where it does not. A file whose table is not valid
    (seconds_table) counts as absent: measured again and overwritten. A measured table with a zero (a step under
    the timer's resolution) is used by this run but not written: a cached zero would make every later run's rounds
    free."""
    path = _table_file(key)
    table = _read_table(path, key) if use_file else {}
    missing = [r for r in row_points(max_rows) if r not in table]
    for r in missing:
        table[r] = seconds_of(r)
    if missing and use_file and seconds_table(table, zero_ok=False) is not None:
        _write_table(path, key, table)
    return {r: table[r] for r in row_points(max_rows)}


def forward_costs(model, max_rows: int, *, use_file: bool = True) -> dict:
    """{rows: seconds} of `model`'s forward at row_points(max_rows) (see cost_table)."""
    return cost_table(table_key(model), lambda rows: forward_seconds(model, rows), max_rows, use_file=use_file)


def draft_costs(drafter, device: torch.device, max_rows: int, *, use_file: bool = True) -> dict | None:
    """{rows: seconds} of one draft step of `drafter` (its cost_probe) at row_points(max_rows); None when the
    drafter does not say."""
    probe = drafter.cost_probe()
    if probe is None:
        return None
    key, prepare = probe
    key = {**environment(device), **key}
    return cost_table(key, lambda rows: step_seconds(prepare(rows), device), max_rows, use_file=use_file)

"""End to end on synthetic targets: the round's efficiency against the Leviathan bound, on the CPU or a GPU.

A synthetic target (specdec_ext.models.synthetic: real shapes, random weights made on the device) decodes a batch of
random prompts plainly; that run is the reference. OracleDrafter then proposes the reference's next k tokens, each
wrong with probability 1 - a, optionally running a synthetic draft model's real steps for their cost. So the
acceptance is set, and what the benchmark measures is the system around it.

Per row, with c and v the costs of one draft step and of the verify forward (k + 1 tokens) in units of one plain
decode step, each an isolated step (graph-replayed on CUDA) at the run's mean context:

    tokens_per_round_formula = mean over rounds of (1 - a^(k_r + 1)) / (1 - a)   (k_r: that round's drafts)
    bound                    = tokens_per_round / (k * c + v)   (the realised tokens per round)
    efficiency               = speedup / bound                  (speedup: speculative over our plain decoding)

Tokens/s count decoding time: each run's elapsed time less its prompts' prefill (GenerationStats.prefill_s), for
plain and speculative runs alike. The round's time is split into the isolated steps (k draft steps, the verify
forward, the sampling kernel, the KV truncation) and the rest ("host": Python, uploads, the round's read, graph
bookkeeping), all per round. On CUDA, host synchronisations per round are counted (torch's sync debug mode plus
the round's one read) and graph captures after the warm-up (re-captures).
"""
import contextlib
import math
import statistics
import warnings

import torch

from specdec_ext.drafters import OracleDrafter
from specdec_ext.engine import SpeculativeDecoder
from specdec_ext.engine import rounds as round_module
from specdec_ext.graphs import StepGraphs
from specdec_ext.ops import chain_speculative_sampling_from_logits, sample_without_drafts
from specdec_ext.trees import TreeSettings

from .common import copy_bandwidth_gbs, cuda_graph, elapsed_us, median_us, print_row, report

SYNTHETIC_SAMPLING = {"greedy": ({}, "rejection"), "invariant": ({"temperature": 0.7, "top_p": 0.9}, "invariant")}
PROMPT_LEN = 32


# ------------------------------------------------------------------------------------------------ the formulas

def chain_tokens_per_round(a: float, k: int) -> float:
    """E[tokens per round] of a chain of k drafts each accepted with probability a: (1 - a^(k+1)) / (1 - a)."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def leviathan_bound(tokens_per_round: float, k: int, c: float, v: float) -> float:
    """The speedup a round can reach: tokens per round over its cost in plain decode steps (k draft steps of cost c,
    one verify forward of cost v)."""
    return tokens_per_round / (k * c + v)


def realised(request_stats, a: float):
    """(tokens per round, the chain formula at each round's own k, rounds of the batch) over rounds with drafts."""
    ks = [k for s in request_stats for k in s.k_per_round if k > 0]
    accepted = sum(s.num_accepted_tokens for s in request_stats)
    tokens = 1 + accepted / len(ks) if ks else 1.0
    formula = statistics.fmean(chain_tokens_per_round(a, k) for k in ks) if ks else 1.0
    return tokens, formula, max(len(s.k_per_round) for s in request_stats)


def first_difference(a: list, b: list):
    """(request, position) of the first token where two runs' outputs part, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        for j in range(max(len(x), len(y))):
            if j >= len(x) or j >= len(y) or x[j] != y[j]:
                return i, j
    return None


# ------------------------------------------------------------------------------------------- isolated steps

def replayable(fn, device: torch.device):
    """fn as the decoder's rounds run it: on CUDA a CUDA graph of it (replay), fn itself when it cannot be captured
    (with a warning) or on the CPU."""
    if device.type != "cuda":
        return fn
    try:
        return cuda_graph(fn).replay
    except RuntimeError as error:
        warnings.warn(f"a step could not be captured ({str(error)[:80]}): timed eagerly")
        return fn


def step_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn, replayed as the rounds run it (replayable)."""
    return median_us(replayable(fn, device), device, repeats, warmup=3) / 1e3


def alternated_ms(fns: list, device: torch.device, repeats: int) -> list:
    """Median milliseconds of each of fns (replayable, without autograd, as the decoder runs them), called in turn
    `repeats` times after 3 warm-up turns, so that a drift of the machine's speed (CPU clocks, another process) hits
    all of them alike."""
    with torch.no_grad():  # with autograd on, the model's CPU linear() takes another path (F.linear)
        steps = [replayable(fn, device) for fn in fns]
        for _ in range(3):
            for step in steps:
                step()
        times = [[elapsed_us(step, device) / 1e3 for step in steps] for _ in range(repeats)]
    return [statistics.median(column) for column in zip(*times)]


class StepCosts:
    """The isolated steps of a round at batch B and context `context`, in milliseconds: the plain decode forward, the
    verify forward of `width` tokens, a draft model's step, the sampling kernel and the truncation. A forward is
    timed alternated with the plain decode step (alternated_ms), which it is divided by for c and v."""

    def __init__(self, target, batch: int, context: int, repeats: int):
        self.target, self.batch, self.context, self.repeats = target, batch, context, repeats
        self.device = target.device
        self.plain_step = self._forward_step(target, 1)

    def _cache(self, model, width: int):
        cache = model.new_kv_cache(self.batch, self.context + width + 1)
        cache.advance(self.context)  # lengths only: what the forward reads, not what it holds, sets its cost
        return cache

    def _forward_step(self, model, width: int):
        cache = self._cache(model, width)
        ids = torch.randint(0, model.config.vocab_size, (self.batch, width), device=self.device)
        rows = slice(0, self.batch)

        return lambda: model(ids, cache, cache_rows=rows)

    def relative(self, step) -> tuple:
        """(the plain decode step's ms, step's ms), timed alternately."""
        return tuple(alternated_ms([self.plain_step, step], self.device, self.repeats))

    def forward(self, model, width: int) -> tuple:
        """(plain decode step ms, the forward of `width` tokens of `model` ms), timed alternately."""
        return self.relative(self._forward_step(model, width))

    def sampling(self, width: int, temperature: float) -> float:
        """The chain sampling kernel over [B, width, V] float32 logits with point drafts (plain: width 1)."""
        b, v = self.batch, self.target.config.vocab_size
        logits = torch.randn(b, width, v, device=self.device)
        params = dict(temperature=torch.full((b,), temperature, device=self.device),
                      seed=torch.arange(b, device=self.device), offset=torch.zeros(b, dtype=torch.int64,
                                                                                    device=self.device))
        if width == 1:
            return step_ms(lambda: sample_without_drafts(logits[:, 0], **params), self.device, self.repeats)
        drafts = torch.randint(0, v, (b, width - 1), device=self.device)
        return step_ms(lambda: chain_speculative_sampling_from_logits(drafts, logits, None, **params), self.device,
                       self.repeats)

    def truncation(self, width: int) -> float:
        cache = self._cache(self.target, width)
        saved = cache.cache_seqlens.clone()
        keep = torch.full((self.batch,), width, dtype=torch.int32, device=self.device)
        rows = slice(0, self.batch)

        def step():
            cache.cache_seqlens.copy_(saved)
            cache.truncate(keep, rows, free_pages=False)
        return step_ms(step, self.device, self.repeats)


# ---------------------------------------------------------------------------------------------- the run

@contextlib.contextmanager
def counted_syncs(device: torch.device):
    """counts["syncs"]: synchronisations torch's sync debug mode reports inside the block (CUDA), counts["reads"]:
    the rounds' reads of their results, counts["captures"]: CUDA graphs captured."""
    counts = {"syncs": 0, "reads": 0, "captures": 0}
    real_read, real_capture = round_module.read, StepGraphs.capture

    def read(t):
        counts["reads"] += 1
        return real_read(t)

    def capture(self, *args, **kwargs):
        counts["captures"] += 1
        return real_capture(self, *args, **kwargs)

    round_module.read, StepGraphs.capture = read, capture
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield counts
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        round_module.read, StepGraphs.capture = real_read, real_capture
    counts["syncs"] = sum("synchroniz" in str(w.message) for w in caught)


def timed(run, repeats: int):
    """Median seconds of decoding (a run's elapsed time less its prompts' prefill) over `repeats` runs of run()
    (after the caller's warm-up), and the last output. The prefill is left out of both plain and speculative runs:
    the bound is about decode steps (on CUDA only its launches are counted in it; the device's prefill of 32-token
    prompts is under 1% of 128 decode steps)."""
    times, out = [], None
    for _ in range(repeats):
        out = run()
        times.append(out.stats.elapsed_s - out.stats.prefill_s)
    return statistics.median(times), out


def synthetic_rows(args, device: torch.device) -> tuple[dict, list]:
    """Every row of --batch x --draft x --oracle-acceptance x --k (and --tree) x --sampling on the synthetic target."""
    from specdec_ext.models import describe_shape, output_is_degenerate, synthetic

    name = args.target.partition(":")[2]
    target = synthetic(name, device=device, seed=0)
    print(f"target synthetic:{name}: {describe_shape(target.config)}, {target.dtype}, {device}", flush=True)
    weight_bytes = sum(t.numel() * t.element_size() for t in target.parameters())
    bandwidth = copy_bandwidth_gbs(device)
    print(f"copy bandwidth {bandwidth:.1f} GB/s (read + write), weights {weight_bytes / 1e9:.2f} GB", flush=True)
    drafts = {}
    for spec in (args.draft or "none").split(","):
        if spec == "none":
            drafts[spec] = None
        elif spec == "head":
            drafts[spec] = synthetic("head", device=device, seed=1, target_config=target.config)
        elif spec.startswith("synthetic:"):
            drafts[spec] = synthetic(spec.partition(":")[2], device=device, seed=1)
        else:
            raise ValueError(f"--draft with a synthetic target: synthetic:NAME, head or none, got {spec!r}")
    acceptances = [float(a) for a in args.oracle_acceptance.split(",")]
    ks = [int(k) for k in (args.k or "4").split(",")]
    trees = [None] + [TreeSettings.of(t) for t in (args.tree or []) if t != "none"]
    modes = (args.sampling or "greedy").split(",")
    new_tokens, repeats = args.new_tokens, args.repeats
    graphs = device.type == "cuda" and args.cuda_graphs == "on"
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch:
        prompts = torch.randint(0, target.config.vocab_size, (batch, PROMPT_LEN), generator=generator).tolist()
        costs = StepCosts(target, batch, PROMPT_LEN + new_tokens // 2, max(repeats * 10, 20))
        for mode in modes:
            params, sampling = SYNTHETIC_SAMPLING[mode]
            seeds = list(range(batch))
            plain = SpeculativeDecoder(target, None, max_batch_size=batch, sampling=sampling, cuda_graphs=graphs)

            def run_plain():
                return plain.generate_autoregressive(prompts, new_tokens, seed=seeds, **params)
            run_plain()  # warm-up: graphs captured
            plain_s, reference = timed(run_plain, repeats)
            degenerate = output_is_degenerate(reference.sequences[0])
            references = [p + s for p, s in zip(prompts, reference.sequences)]
            plain_tps = batch * new_tokens / plain_s
            floor_tps = batch * bandwidth * 1e9 / weight_bytes
            for draft_name, draft_model in drafts.items():
                # c: the draft step over the plain step, timed alternately (0: no draft model)
                plain_for_draft, draft_ms = costs.forward(draft_model, 1) if draft_model is not None else (1.0, 0.0)
                for tree in trees:
                    for k in ks if tree is None else [tree.depth]:
                        # the verify block: the chain, or the oracle's tree (its path and branching - 1 siblings
                        # per path node, within the node budget)
                        width = k + 1 if tree is None else 1 + min(tree.num_nodes - 1, tree.depth * tree.branching)
                        plain_ms, verify_ms = costs.forward(target, width)
                        sample_ms = costs.sampling(width, params.get("temperature", 0.0))
                        truncate_ms = costs.truncation(width)
                        c, v = draft_ms / plain_for_draft, verify_ms / plain_ms
                        for a in acceptances:
                            row = one_row(target, draft_model, references, prompts, seeds, params, sampling, batch,
                                          k, tree, a, graphs, repeats, new_tokens, reference.sequences, plain_tps,
                                          device)
                            round_ms = row.pop("round_ms")
                            steps_ms = k * draft_ms + verify_ms + sample_ms + truncate_ms
                            bound = leviathan_bound(row["tokens_per_round"], k, c, v)
                            rows.append({
                                "B": batch, "sampling": mode, "draft": draft_name, "k": k,
                                "tree": "-" if tree is None else f"{tree.num_nodes}/{tree.depth}/{tree.branching}",
                                "oracle_acceptance": a, "plain_tok_s": plain_tps, "of_floor": plain_tps / floor_tps,
                                "tok_s": row["tok_s"], "speedup": row["tok_s"] / plain_tps,
                                "tokens_per_round": row["tokens_per_round"],
                                "tokens_per_round_formula": row["formula"] if tree is None else None,
                                "c": c, "v": v, "bound": bound, "efficiency": row["tok_s"] / plain_tps / bound,
                                "round_ms": round_ms, "draft_ms": k * draft_ms, "verify_ms": verify_ms,
                                "sample_ms": sample_ms, "truncate_ms": truncate_ms,
                                "host_ms": round_ms - steps_ms, "plain_step_ms": plain_ms,
                                "plain_round_ms": 1e3 * batch / plain_tps,  # plain decoding per step, overhead included
                                "syncs_per_round": row["syncs_per_round"], "recaptures": row["recaptures"],
                                "same_as_plain": row["same_as_plain"], "parted_at": row["parted_at"],
                                "reference_degenerate": degenerate or "-"})
                            print_row(rows[-1])
    meta = {"title": f"synthetic {name} end to end", "target": args.target, "config": describe_shape(target.config),
            "dtype": str(target.dtype), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "copy_bw_gbs": bandwidth, "weight_bytes": weight_bytes, "new_tokens": new_tokens,
            "prompt_len": PROMPT_LEN, "cuda_graphs": graphs, "threads": torch.get_num_threads()}
    report(f"synthetic {name} ({meta['config']}), {meta['dtype']}, {meta['device']}, {new_tokens} new tokens; "
           f"speedup over our plain decoding; bound = tokens_per_round / (k c + v); efficiency = speedup / bound; "
           f"times per round in ms", rows,
           ["B", "sampling", "draft", "k", "tree", "oracle_acceptance", "plain_tok_s", "of_floor", "tok_s", "speedup",
            "tokens_per_round", "tokens_per_round_formula", "c", "v", "bound", "efficiency", "round_ms", "draft_ms",
            "verify_ms", "sample_ms", "truncate_ms", "host_ms", "plain_step_ms", "plain_round_ms", "syncs_per_round",
            "recaptures", "same_as_plain"])
    return meta, rows


def one_row(target, draft_model, references, prompts, seeds, params, sampling, batch, k, tree, a, graphs, repeats,
            new_tokens, plain_sequences, plain_tps, device) -> dict:
    """One speculative configuration: warm-up, timed runs, then one counted run (syncs, reads, captures)."""
    decoder = SpeculativeDecoder(target, OracleDrafter(references, a, seed=0, draft_model=draft_model), k,
                                 adaptive=False, max_batch_size=batch, tree=tree, sampling=sampling,
                                 cuda_graphs=graphs)

    def run():
        return decoder.generate(prompts, new_tokens, seed=seeds, **params)
    run()  # warm-up: graphs captured
    seconds, out = timed(run, repeats)
    tokens, formula, rounds = realised(out.request_stats, a)
    with counted_syncs(device) as counts:
        run()
    reads_and_syncs = counts["reads"] + counts["syncs"] if device.type == "cuda" else math.nan
    return {"tok_s": batch * new_tokens / seconds, "tokens_per_round": tokens, "formula": formula,
            "round_ms": seconds / rounds * 1e3, "syncs_per_round": reads_and_syncs / rounds,
            "recaptures": counts["captures"], "same_as_plain": out.sequences == plain_sequences,
            "parted_at": first_difference(plain_sequences, out.sequences) or "-"}


def plot(rows: list, path: str, meta: dict) -> None:
    """Speedup against the oracle's acceptance, one panel per batch size, a line per (draft, chain or tree, sampling),
    the bound of each point dashed in the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.5), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        series = {}
        for r in rows:
            if r["B"] == b:
                series.setdefault((r["draft"], r["k"], r["tree"], r["sampling"]), []).append(r)
        for (draft, k, tree, mode), points in series.items():
            points.sort(key=lambda r: r["oracle_acceptance"])
            a = [r["oracle_acceptance"] for r in points]
            line, = ax.plot(a, [r["speedup"] for r in points], "o-" if mode == "greedy" else "s-",
                            label=f"draft {draft}, {'k=' + str(k) if tree == '-' else 'tree ' + tree}, {mode}")
            ax.plot(a, [r["bound"] for r in points], "--", color=line.get_color(), lw=0.8)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xlabel("oracle acceptance a")
        ax.set_title(f"B = {b}", fontsize=9)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("speedup over plain decoding (dashed: bound)")
    fig.suptitle(f"{meta['title']}, {meta['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")

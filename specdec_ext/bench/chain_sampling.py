"""chain_speculative_sampling (probabilities and logits), ours against PyTorch and the reference.

Two baselines run in the same process: `torch`, an efficient vectorised implementation (float32 softmax
over the whole [B, K+1, V] tensors, acceptance by gather, the residual row gathered per request and sampled
by an exponential race), and `reference`, the readable float64 oracle of specdec_ext.reference.
graph_us is the op replayed from a CUDA graph (the kernel without Python's launch overhead). bytes are those the op
must read: the rows up to the first rejection (all of them for logits, whose normalisers need every entry) and the
row the last token is drawn from; with probabilities, acceptance itself needs only p(x) and q(x), and so does the path
`logits+lse`, logits with the caller's normalisers (target_lse, draft_lse from logits_normalizer, computed before the
timing as an LM head's epilogue would have them). floor_us is their
time at the copy bandwidth measured in the run, GB/s their rate at graph_us, of_copy_bw = floor_us / graph_us; grid
is the CUDA launch, blocks x threads (an H200's when run on the CPU).
--against flashinfer adds FlashInfer's chain_speculative_sampling on the same float32 probabilities (vs_flashinfer:
its time over ours). Also reported: the cost per row of Gumbel coupling's draw (gumbel_sample) against the op's
inverse-CDF bonus draw.
"""
import inspect

import torch

import specdec_ext
from specdec_ext import reference

from ..factory import choose_device
from .common import (
    add_common_arguments,
    copy_bandwidth_gbs,
    cuda_graph,
    import_flashinfer,
    int_list,
    median_us,
    print_row,
    report,
    sampling_grid,
    save,
)


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[1, 8, 64], help="batch sizes B (default 1,8,64)")
    parser.add_argument("--k", type=int_list, default=[1, 4, 8], help="draft tokens per request K (default 1,4,8)")
    parser.add_argument("--vocab", type=int_list, default=[32000, 128256],
                        help="vocabulary sizes V (default 32000,128256)")
    parser.add_argument("--against", choices=["flashinfer"], default=None,
                        help="also time FlashInfer's chain_speculative_sampling on the same inputs (float32 "
                             "probabilities), when flashinfer imports")
    add_common_arguments(parser)


def make_case(batch, k, vocab, dtype, device, gen):
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2.5
    draft = logits[:, :k] + 0.8 * torch.randn(batch, k, vocab, generator=gen)
    q = torch.softmax(draft, -1)
    ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k).int()
    def to(t):
        return t.to(device=device, dtype=dtype)
    return {"ids": ids.to(device), "target_logits": to(logits), "draft_logits": to(draft),
            "target_probs": to(torch.softmax(logits, -1)), "draft_probs": to(q),
            "seed": torch.randint(0, 2**62, (batch,), generator=gen).to(device)}


def torch_sampling(ids, target_probs, draft_probs):
    """An efficient PyTorch implementation of the same algorithm (its own RNG)."""
    batch, k = ids.shape
    ids = ids.long()
    p_x = target_probs[:, :k].gather(-1, ids[..., None]).squeeze(-1).float()
    q_x = draft_probs.gather(-1, ids[..., None]).squeeze(-1).float()
    u = torch.rand(batch, k, device=ids.device)
    accepted = ((u * q_x < p_x).long().cumprod(-1)).sum(-1)
    rows = torch.arange(batch, device=ids.device)
    p_j = target_probs[rows, accepted].float()
    q_j = torch.where((accepted < k)[:, None], draft_probs[rows, accepted.clamp_max(k - 1)].float(), 0.0)
    residual = (p_j - q_j).clamp_min_(0)
    token = (residual / torch.empty_like(residual).exponential_()).argmax(-1)
    out = torch.where(torch.arange(k + 1, device=ids.device) < accepted[:, None], torch.cat([ids, ids[:, :1]], 1), -1)
    out[rows, accepted] = token
    return out, accepted


def torch_sampling_from_logits(ids, target_logits, draft_logits, temperature):
    return torch_sampling(ids, torch.softmax(target_logits.float() / temperature, -1),
                          torch.softmax(draft_logits.float() / temperature, -1))


def graph_replay_us(fn, device, repeats):
    return median_us(cuda_graph(fn).replay, device, repeats)


def bytes_read(out, k, vocab, elem, logits):
    accepted = out.num_accepted.long()
    rejected = accepted < k
    if logits:  # both rows at every position reached, plus the bonus row
        rows = torch.where(rejected, 2 * (accepted + 1), 2 * k + 1)
    else:  # the row the last token is drawn from (target and draft when rejected)
        rows = torch.where(rejected, 2, 1)
    return int(rows.sum()) * vocab * elem


def main(args) -> int:
    device = choose_device(args.device)
    peak = copy_bandwidth_gbs(device)
    flashinfer = import_flashinfer(args.against == "flashinfer")
    anchor = flashinfer.sampling if flashinfer is not None else None
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in args.vocab:
            for batch in args.batch:
                for k in args.k:
                    # The same draws for every dtype, so that dtypes are compared on the same acceptance pattern.
                    gen = torch.Generator().manual_seed(batch * 1000 + k * 10 + vocab)
                    case = make_case(batch, k, vocab, dtype, device, gen)
                    for path in ("probs", "logits", "logits+lse"):
                        rows.append(measure(case, path, batch, k, vocab, dtype, device, args.repeats, peak,
                                            anchor))
                        print_row(rows[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    noise = [noise_cost(vocab, dtype, device, args.repeats) for dtype in (torch.float32, torch.bfloat16)
             for vocab in args.vocab]
    report(f"the cost of Gumbel coupling per verify row on {name}: one token drawn from each of 64 rows of logits "
           f"(T = 0.7) by the Gumbel-max of its position (coupling='gumbel') and by inverse CDF (rejection sampling's "
           f"bonus draw)", noise, ["dtype", "V", "gumbel_us_per_row", "inverse_cdf_us_per_row", "ratio"])
    report(f"chain speculative sampling on {name} (copy bandwidth {peak:.0f} GB/s)", rows,
           ["path", "dtype", "B", "K", "V", "accepted", "ours_us", "graph_us", "torch_us", "speedup", "reference_us",
            "vs_reference", "bytes", "floor_us", "GB/s", "of_copy_bw", "grid"] +
           (["flashinfer_us", "vs_flashinfer"] if anchor is not None else []))
    save(args, {"title": f"chain speculative sampling, {name}", "device": name, "copy_bw_gbs": peak,
                "gumbel_noise": noise}, rows,
         ["path", "dtype", "B", "K", "V"])
    return 0


def noise_cost(vocab, dtype, device, repeats, rows=64):
    """Microseconds per row of a token drawn from rows of logits by gumbel_sample (the noise of every in-reach
    entry: Philox and two logarithms) and by the chain op's bonus draw (softmax statistics and inverse CDF)."""
    from ..ops import sample_without_drafts

    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(device=device, dtype=dtype)
    t = torch.full((rows,), 0.7, device=device)
    seed, positions = torch.arange(rows, device=device), torch.arange(rows, device=device) * 7
    gumbel = median_us(lambda: specdec_ext.gumbel_sample(logits, temperature=t, seed=seed, positions=positions), device,
                       repeats)
    inverse = median_us(lambda: sample_without_drafts(logits, temperature=t, seed=seed, offset=positions), device,
                        repeats)
    return {"dtype": str(dtype).replace("torch.", ""), "V": vocab, "gumbel_us_per_row": gumbel / rows,
            "inverse_cdf_us_per_row": inverse / rows, "ratio": gumbel / inverse}


def measure(case, path, batch, k, vocab, dtype, device, repeats, peak, anchor=None):
    """One row. anchor: flashinfer.sampling (or None): its chain_speculative_sampling timed on the same float32
    probabilities (it has no from-logits form), replayed from a CUDA graph on a GPU as ours is."""
    ids, seed = case["ids"], case["seed"]
    if path == "probs":
        tp, dp = case["target_probs"], case["draft_probs"]
        def ours():
            return specdec_ext.chain_speculative_sampling(ids, tp, dp, seed=seed)
        def base():
            return torch_sampling(ids, tp, dp)
        def ref():
            return reference.chain_speculative_sampling(ids, tp, dp, seed=seed)
    else:
        tl, dl = case["target_logits"], case["draft_logits"]
        t = torch.ones(batch, device=device)  # a device tensor: ours is also captured in a CUDA graph below
        lse = {}
        if path == "logits+lse":
            lse = {"target_lse": specdec_ext.logits_normalizer(tl, temperature=t[:, None].expand(-1, k + 1)),
                   "draft_lse": specdec_ext.logits_normalizer(dl, temperature=t[:, None].expand(-1, k))}
        def ours():
            return specdec_ext.chain_speculative_sampling_from_logits(ids, tl, dl, temperature=t, seed=seed, **lse)
        def base():
            return torch_sampling_from_logits(ids, tl, dl, 1.0)
        def ref():
            return reference.chain_speculative_sampling_from_logits(ids, tl, dl, temperature=1.0, seed=seed)
    big = batch * k * vocab >= 8 * 4 * 128256
    slow_repeats = max(3, repeats // (10 if big else 4))
    ours_us = median_us(ours, device, repeats)
    torch_us = median_us(base, device, max(5, repeats // 2))
    ref_us = median_us(ref, device, slow_repeats, warmup=1)
    out = ours()
    nbytes = bytes_read(out, k, vocab, torch.finfo(dtype).bits // 8, path == "logits")
    # The kernel alone: replayed from a CUDA graph, as an engine runs it, without Python's launch overhead.
    graph_us = graph_replay_us(ours, device, repeats) if device.type == "cuda" else ours_us
    gbs = nbytes / (graph_us * 1e-6) / 1e9
    row = {"path": path, "dtype": str(dtype).replace("torch.", ""), "B": batch, "K": k, "V": vocab,
           "accepted": float(out.num_accepted.float().mean()), "ours_us": ours_us, "graph_us": graph_us,
           "torch_us": torch_us, "speedup": torch_us / ours_us, "reference_us": ref_us,
           "vs_reference": ref_us / ours_us, "bytes": nbytes, "floor_us": nbytes / (peak * 1e9) * 1e6, "GB/s": gbs,
           "of_copy_bw": gbs / peak, "grid": sampling_grid(batch, device)}
    if anchor is not None:
        row["flashinfer_us"] = flashinfer_us(anchor, case, path, dtype, device, repeats)
        row["vs_flashinfer"] = row["flashinfer_us"] / graph_us
    return row


def flashinfer_us(anchor, case, path, dtype, device, repeats) -> float:
    """FlashInfer's chain_speculative_sampling on the case's float32 probabilities (its form: draft_probs,
    draft_token_ids, target_probs; seed and offset as device tensors so that a CUDA graph replays it), NaN where it
    has no counterpart (from logits, bfloat16) or fails."""
    if path != "probs" or dtype != torch.float32:
        return float("nan")
    ids, tp, dp = case["ids"], case["target_probs"], case["draft_probs"]
    # seed and offset where its release takes them (0.5 does, 0.3 draws from the default generator)
    keywords = inspect.signature(anchor.chain_speculative_sampling).parameters
    seeded = dict(seed=case["seed"], offset=torch.zeros_like(case["seed"])) if "seed" in keywords else {}

    def call():
        return anchor.chain_speculative_sampling(dp, ids, tp, **seeded)
    try:
        call()  # its first call compiles the kernel (JIT): outside the timing
    except Exception as error:  # a kernel that does not build or run here: the column says NaN, the run goes on
        print(f"flashinfer chain_speculative_sampling failed ({type(error).__name__}: {str(error)[:120]})")
        return float("nan")
    if device.type == "cuda":
        try:
            return graph_replay_us(call, device, repeats)
        except RuntimeError as error:  # not capturable (its generator use): timed from Python, launch included
            print(f"flashinfer chain_speculative_sampling timed eagerly ({str(error)[:80]})")
    return median_us(call, device, repeats)

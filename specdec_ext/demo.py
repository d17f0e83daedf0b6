"""`specdec demo`: the ops end to end on one device, checked against the reference and the emulator.

It shows the RNG every sampling op draws from (per-request Philox streams that do not depend on batch
composition or device), one verify round of chain speculative sampling, and the shipped model answering a chat
question through speculative decoding, against plain decoding.
"""
import time

import torch

import specdec_ext
from specdec_ext import reference
from specdec_ext.generate import tree_settings


def sampling_demo(device: torch.device) -> bool:
    """One verify round for 50,000 requests drafting K=4 tokens from q against a target p: the first emitted
    token follows p exactly, and the mean accepted count is Leviathan et al.'s sum of alpha^i."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 16, 4, 50_000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.log(p) + 0.6 * torch.randn(vocab, generator=g), -1)
    drafts = torch.multinomial(q.expand(n, vocab), k, replacement=True, generator=g).int()
    out = specdec_ext.chain_speculative_sampling(
        drafts.to(device), p.expand(n, k + 1, vocab).contiguous().to(device), q.expand(n, k, vocab).contiguous().to(device),
        seed=torch.arange(n, device=device), offset=0)
    first = torch.bincount(out.output_token_ids[:, 0].long().cpu(), minlength=vocab).double() / n
    tv = 0.5 * float((first - p.double()).abs().sum())
    alpha = float(torch.minimum(p, q).sum())
    mean = float(out.num_accepted.double().mean())
    print(f"chain_speculative_sampling, {n} requests, K={k}, V={vocab}: mean accepted {mean:.3f} "
          f"(theory {sum(alpha**i for i in range(1, k + 1)):.3f}); total variation of the first token from the "
          f"target {tv:.4f} (sampling noise ~{(vocab / n) ** 0.5 / 2:.4f})")
    return tv < 0.02


# An ordinary chat question for the trained heads; a rewriting request, as in retrieval-augmented chat, for prompt
# lookup: its answer reuses the note's wording, which the n-gram drafter drafts from (on answers that copy nothing
# it gains little: bench/RESULTS.md).
QUESTIONS = {
    "eagle": "What is the capital of France? Tell me about the city in a few sentences.",
    "ngram": "Here is a note: 'Paris is the capital of France. The Eiffel Tower in Paris was completed in 1889 and is "
             "330 metres tall. The Louvre in Paris is the most visited museum in the world.' Rewrite the note as a "
             "bulleted list, keeping its wording.",
}
QUESTIONS["medusa"] = QUESTIONS["eagle"]


def chat_demo(device: torch.device, drafter: str = "eagle", tree=None) -> bool:
    """The shipped model (SmolLM2-135M-Instruct) answers a chat question through speculative decoding with its
    shipped EAGLE head (or Medusa heads, or the n-gram drafter), streamed as it is generated; then the same request
    by plain decoding: the same tokens (greedy), the speedup and the acceptance stats. tree: tree rounds of these
    settings (TreeSettings) instead of chains."""
    from specdec_ext import SpeculativeDecoder
    from specdec_ext.generate import load, make_drafter, prompt_ids
    from specdec_ext.models import default_model_path

    path = default_model_path()
    t0 = time.perf_counter()
    model, tokenizer = load(path, device)
    print(f"loaded {path.name} in {time.perf_counter() - t0:.1f} s")
    question = QUESTIONS[drafter]
    ids = prompt_ids(tokenizer, question, chat=True)
    k = 6 if drafter == "ngram" else 4
    dec = SpeculativeDecoder(model, make_drafter(drafter, model, path), num_speculative_tokens=k, max_batch_size=1,
                             tree=tree)
    shape = f"k <= {k}" if tree is None else f"trees of <= {dec.tree.num_nodes} nodes, depth {dec.tree.depth}"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    spec = dec.generate([ids], 96, eos_token_id=tokenizer.eos_token_id,
                        stream=lambda r, new: print(tokenizer.decode(new, skip_special_tokens=True), end="", flush=True))
    plain = dec.generate_autoregressive([ids], 96, eos_token_id=tokenizer.eos_token_id)
    again = dec.generate([ids], 96, eos_token_id=tokenizer.eos_token_id)  # timed after a warm run, like plain
    s, p = again.stats, plain.stats
    print(f"\nplain decoding {p.tokens_per_second:.1f} tokens/s, speculative ({drafter}, {shape}, adaptive) "
          f"{s.tokens_per_second:.1f} tokens/s: speedup {s.tokens_per_second / p.tokens_per_second:.2f}x "
          f"({s.generated_tokens} tokens, prefill included)")
    print(f"acceptance rate {s.acceptance_rate:.2f}, mean acceptance length {s.mean_acceptance_length:.2f}, "
          f"{s.num_draft_tokens} draft tokens in {s.num_drafts} rounds with drafts (mean accepted depth "
          f"{s.mean_accepted_depth:.2f}), accepted per position {s.accepted_per_position}; time: draft "
          f"{s.draft_s:.2f} s, verify {s.verify_s:.2f} s, "
          f"sample {s.sample_s:.2f} s, other {s.other_s:.2f} s")
    same = spec.sequences == plain.sequences == again.sequences
    print(f"speculative tokens equal plain greedy decoding's: {same}")
    return same and "paris" in tokenizer.decode(spec.sequences[0]).lower()


def register(sub) -> None:
    demo = sub.add_parser("demo", help="the ops end to end, and the shipped model speculative against plain")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--drafter", default="eagle", choices=sorted(QUESTIONS),
                      help="the shipped model's drafter: its trained EAGLE head (default), Medusa heads, or prompt lookup")
    demo.add_argument("--tree", default=None, type=tree_settings,
                      help="tree rounds: N (nodes per tree) or nodes=N,depth=D,branching=K")
    demo.set_defaults(fn=lambda args: main(device=args.device, drafter=args.drafter, tree=args.tree))


def main(device: str | None = None, drafter: str = "eagle", tree=None) -> int:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"specdec_ext {specdec_ext.__version__} on {device}")
    seeds = torch.tensor([2024, 7, 2**62 + 1, -5], device=device)
    steps = torch.tensor([0, 1, 2, 3], device=device)
    u = specdec_ext.philox_uniform(seeds, steps, n=6, stream=1)
    print("philox_uniform(seed, offset=decode step, n=6, stream=1):")
    for s, o, row in zip(seeds.tolist(), steps.tolist(), u.cpu()):
        print(f"  seed {s:>20} step {o}: " + " ".join(f"{x:.6f}" for x in row.tolist()))

    alone = specdec_ext.philox_uniform(seeds[2:3], steps[2:3], n=6, stream=1)
    print(f"request 2 computed alone equals its row in the batch: {torch.equal(alone[0], u[2])}")
    ref = reference.philox_uniform(seeds.cpu(), steps.cpu(), 6, 1)
    print(f"bit-exact with the PyTorch reference: {torch.equal(u.cpu(), ref)}")
    ok = torch.equal(alone[0], u[2]) and torch.equal(u.cpu(), ref)
    try:
        from specdec_ext import sim

        emulated = sim.philox_uniform(seeds.cpu(), steps.cpu(), 6, 1)
        same = torch.equal(emulated, ref)
        print(f"the CUDA kernel's source under the SIMT emulator agrees: {same}")
        ok = ok and same
    except ImportError:
        print("emulator extension not built: skipped")

    ok = sampling_demo(device) and ok
    ok = chat_demo(device, drafter, tree) and ok

    big = 1 << 24
    specdec_ext.philox_uniform(seeds, steps, big)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = specdec_ext.philox_uniform(seeds, steps, big)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"{x.numel() / 1e6:.0f}M uniforms in {dt * 1e3:.1f} ms ({x.numel() * 4 / dt / 1e9:.1f} GB/s written); "
          f"min {x.min().item():.3g} > 0, max {x.max().item():.9f} < 1")
    ok = ok and 0 < x.min().item() and x.max().item() < 1
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1

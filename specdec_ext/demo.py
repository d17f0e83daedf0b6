"""`specdec demo`: the ops end to end on one device, checked against the reference and the emulator.

It shows the RNG every sampling op draws from (per-request Philox streams that do not depend on batch
composition or device), one verify round of chain speculative sampling, and the shipped model on two tasks through
speculative decoding, against plain decoding: a chat question (drafted by its trained EAGLE head) and rewriting a
note (drafted by n-gram prompt lookup), the drafter of each by the rule of DRAFTER_RULE.
"""
import json
import time

import torch

import specdec_ext
from specdec_ext import reference
from specdec_ext.drafters.registry import drafter_entry, drafters


def sampling_demo(device: torch.device) -> bool:
    """One verify round for 50,000 requests drafting K=4 tokens from q against a target p: the first emitted
    token follows p exactly, and the mean accepted count is Leviathan et al.'s sum of alpha^i."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 16, 4, 50_000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.log(p) + 0.6 * torch.randn(vocab, generator=g), -1)
    drafts = torch.multinomial(q.expand(n, vocab), k, replacement=True, generator=g).int()
    out = specdec_ext.chain_speculative_sampling(
        drafts.to(device), p.expand(n, k + 1, vocab).contiguous().to(device),
        q.expand(n, k, vocab).contiguous().to(device), seed=torch.arange(n, device=device), offset=0)
    first = torch.bincount(out.output_token_ids[:, 0].long().cpu(), minlength=vocab).double() / n
    tv = 0.5 * float((first - p.double()).abs().sum())
    alpha = float(torch.minimum(p, q).sum())
    mean = float(out.num_accepted.double().mean())
    print(f"chain_speculative_sampling, {n} requests, K={k}, V={vocab}: mean accepted {mean:.3f} "
          f"(theory {sum(alpha**i for i in range(1, k + 1)):.3f}); total variation of the first token from the "
          f"target {tv:.4f} (sampling noise ~{(vocab / n) ** 0.5 / 2:.4f})")
    return tv < 0.02


# The demo's two tasks: the product at its typical (an open-ended chat question) and at its best (a rewriting request,
# as in retrieval-augmented chat or code editing, whose answer reuses the prompt's wording). The drafter of each task,
# by one rule (not by timing on this machine): an answer asked to reuse the prompt's own text (rewriting, editing,
# extracting) is drafted by prompt lookup, which copies the prompt's spans for free; an open-ended answer by the
# trained EAGLE head, which predicts the model's own next tokens (bench/RESULTS.md: prompt lookup gains little on
# answers that copy nothing).
TASKS = {  # name -> (what it is, the drafter the rule gives it, its question)
    "chat": ("an open-ended chat question", "eagle",
             "What is the capital of France? Tell me about the city in a few sentences."),
    "rewrite": ("rewriting a note, keeping its wording", "ngram",
                "Here is a note: 'Paris is the capital of France. The Eiffel Tower in Paris was completed in 1889 and "
                "is 330 metres tall. The Louvre in Paris is the most visited museum in the world.' Rewrite the note "
                "as a bulleted list, keeping its wording."),
}
# Each task's question by the drafter the rule gives it (bench/cpu_forward.py times the rewriting task's).
QUESTIONS = {drafter: question for _, drafter, question in TASKS.values()}
DRAFTER_RULE = ("drafter rule: an answer that reuses the prompt's text (rewriting a note, editing code) -> n-gram "
                "prompt lookup; an open-ended answer -> the trained EAGLE head")
NEW_TOKENS = 96


def demo_drafters() -> list:
    """The names of the registered drafters (drafters/registry.py) `specdec demo --drafter` runs: those that run on the
    shipped model as they are (no draft model to name)."""
    return [e.name for e in drafters() if not e.needs_draft_model]


def task_of(drafter: str) -> str:
    """The task a --drafter runs: rewriting the note when it drafts from the request's own text, as prompt lookup
    does; else the chat question."""
    return "rewrite" if drafter_entry(drafter).drafts_from_the_text else "chat"


def load_shipped_model(device: torch.device):
    from specdec_ext.factory import load
    from specdec_ext.models import default_model_path

    path = default_model_path()
    t0 = time.perf_counter()
    model, tokenizer = load(path, device)
    print(f"loaded {path.name} in {time.perf_counter() - t0:.1f} s")
    return path, model, tokenizer


def chat_demo(device: torch.device, drafter: str = "eagle", tree=None, *, loaded=None, task: str | None = None) -> dict:
    """The shipped model (SmolLM2-135M-Instruct) answers the question of `task` (TASKS; None: the drafter's task_of)
    through speculative decoding with `drafter` (one of demo_drafters: its shipped EAGLE head, Medusa heads, n-gram
    prompt lookup...), streamed as it is generated; then the same request by plain decoding: the same tokens
    (greedy), the speedup and the acceptance stats, timed after a warm run. tree: tree rounds of these settings
    (TreeSettings) instead of chains. loaded: (path, model, tokenizer) already loaded. Returns the task's row: ok
    (the check), and the numbers printed."""
    from specdec_ext import SpeculativeDecoder
    from specdec_ext.factory import make_drafter, prompt_ids
    from specdec_ext.streaming import TextStream

    path, model, tokenizer = loaded or load_shipped_model(device)
    task = task or task_of(drafter)
    question = TASKS[task][2]
    ids = prompt_ids(tokenizer, question, chat=True)
    k = 6 if drafter == "ngram" else 4
    dec = SpeculativeDecoder(model, make_drafter(drafter, model, path), num_speculative_tokens=k, max_batch_size=1,
                             tree=tree)
    shape = f"k <= {k}" if dec.tree is None else f"trees of <= {dec.tree.num_nodes} nodes, depth {dec.tree.depth}"
    text = TextStream(tokenizer)

    def stream(r, new):
        piece = text.push(new)
        if piece:
            print(piece, end="", flush=True)

    print(f"user: {question}\nassistant: ", end="", flush=True)
    eos = tokenizer.eos_token_id
    spec = dec.generate([ids], NEW_TOKENS, eos_token_id=eos, stream=stream)
    print(text.flush(), end="")
    plain = dec.generate_autoregressive([ids], NEW_TOKENS, eos_token_id=eos)
    again = dec.generate([ids], NEW_TOKENS, eos_token_id=eos)  # timed after a warm run, like plain
    s, p = again.stats, plain.stats
    speedup = s.tokens_per_second / p.tokens_per_second
    calibration = s.calibration_s
    print(f"\nplain decoding {p.tokens_per_second:.1f} tokens/s, speculative ({drafter}, {shape}, adaptive) "
          f"{s.tokens_per_second:.1f} tokens/s: speedup {speedup:.2f}x ({s.generated_tokens} tokens, prefill "
          f"included" + (f"; cost-model calibration {calibration:.2f} s apart" if calibration >= 0.005 else "") + ")")
    print(f"acceptance rate {s.acceptance_rate:.2f}, mean acceptance length {s.mean_acceptance_length:.2f}, "
          f"{s.num_draft_tokens} draft tokens in {s.num_drafts} rounds with drafts (mean accepted depth "
          f"{s.mean_accepted_depth:.2f}), accepted per position {s.accepted_per_position}; time: draft "
          f"{s.draft_s:.2f} s, verify {s.verify_s:.2f} s, "
          f"sample {s.sample_s:.2f} s, other {s.other_s:.2f} s")
    if hasattr(dec.drafter, "stats"):  # Lookahead's own counts
        print(dec.drafter.stats.summary())
    same = spec.sequences == plain.sequences == again.sequences
    print(f"speculative tokens equal plain greedy decoding's: {same}")
    answer = tokenizer.decode(spec.sequences[0], skip_special_tokens=True)
    return dict(task=task, drafter=drafter, plain=p.tokens_per_second,
                speculative=s.tokens_per_second, speedup=speedup, acceptance=s.acceptance_rate,
                length=s.mean_acceptance_length, same=same, ok=same and "paris" in answer.lower())


def tasks_demo(device: torch.device, drafter: str | None = None, tree=None) -> bool:
    """The tasks of TASKS, each with the drafter DRAFTER_RULE gives it (drafter: one task, the question of that
    drafter, with it), then a table of the two."""
    loaded = load_shipped_model(device)
    if drafter is None:
        print(DRAFTER_RULE)
        runs = [(name, what, d) for name, (what, d, _) in TASKS.items()]
    else:
        runs = [(task_of(drafter), "chosen by --drafter", drafter)]
    rows = []
    for i, (name, what, d) in enumerate(runs, 1):
        print(f"\n== task {i}/{len(runs)}: {name} ({what}); drafter: {d} ({drafter_entry(d).help})")
        rows.append(chat_demo(device, d, tree, loaded=loaded, task=name))
    print(f"\nsummary (up to {NEW_TOKENS} new tokens each, greedy, timed after a warm run, prefill included):")
    print(f"  {'task':<8} {'drafter':<9} {'plain tok/s':>11} {'speculative tok/s':>17} {'speedup':>7} "
          f"{'acceptance':>10} {'tokens/round':>12}  tokens equal plain greedy")
    for r in rows:
        print(f"  {r['task']:<8} {r['drafter']:<9} {r['plain']:>11.1f} {r['speculative']:>17.1f} "
              f"{r['speedup']:>6.2f}x {r['acceptance']:>10.2f} {r['length']:>12.2f}  {r['same']}")
    return all(r["ok"] for r in rows)


def emulator_check(seeds, steps, ref) -> bool | None:
    """philox_uniform of the CUDA kernel's source under the emulator against the reference; None when the emulator
    is not built. An emulator built with AddressSanitizer runs in a child process with the ASan runtime preloaded
    (importing it here, without the runtime, would abort the demo)."""
    from specdec_ext import _extension

    try:
        from specdec_ext import sim

        return torch.equal(sim.philox_uniform(seeds.cpu(), steps.cpu(), 6, 1), ref)
    except _extension.EmulatorNeedsASanRuntime:
        code = ("import torch; from specdec_ext import sim; "
                f"print(sim.philox_uniform(torch.tensor({seeds.tolist()}), torch.tensor({steps.tolist()}), 6, 1)"
                ".double().tolist())")
        rc, out, err = _extension.run_sim_in_subprocess(code, timeout=120)
        if rc != 0:
            why = (err.strip().splitlines() or [f"exit {rc}"])[-1]
            print(f"emulator (AddressSanitizer build) failed in a child process: {why}")
            return False
        print("(the emulator is built with AddressSanitizer: it runs in a child process with the ASan runtime "
              "preloaded)")
        return torch.equal(torch.tensor(json.loads(out), dtype=torch.float64).float(), ref)
    except ImportError:
        return None


def main(device: str | None = None, drafter: str | None = None, tree=None) -> int:
    from specdec_ext.factory import choose_device

    device = choose_device(device)
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
    same = emulator_check(seeds, steps, ref)
    if same is None:
        print("emulator extension not built: skipped")
    else:
        print(f"the CUDA kernel's source under the SIMT emulator agrees: {same}")
        ok = ok and same

    ok = sampling_demo(device) and ok
    ok = tasks_demo(device, drafter, tree) and ok

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

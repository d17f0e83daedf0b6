"""The vLLM shim on CUDA: the CPU module's checks (tests/helpers/compat_vllm.py) with device="cuda" (greedy cases,
K = 32, the law of the emitted tokens, seeded requests through CUDA generators, mixed batches,
RejectionSampler.forward's processing), and, where vllm is importable, the same greedy and deterministic batches
against vLLM's own rejection sampler."""
import inspect

import pytest
import torch

from helpers.compat_vllm import (
    GREEDY_CASES,
    BonusSampler,
    P,
    argmax_rows,
    bonus_ids,
    check_deterministic_when_seeded,
    check_emitted_tokens_follow_the_target,
    check_greedy_case,
    check_k32,
    check_mixed_greedy_and_random_batch,
    check_rejection_sampler_forward_processes_the_target,
    flat,
    forward_batch,
    sampling_metadata,
    spread_batch,
)
from specdec_ext.compat import vllm as shim

CUDA = "cuda"


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_cases_on_cuda(case):
    check_greedy_case("native", case, CUDA)


def test_k32_on_cuda(gen):
    check_k32("native", gen, CUDA)


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_probs", "point_proposals"])
def test_emitted_tokens_follow_the_target_on_cuda(with_draft):
    # The CPU module's power statement holds: the same 200,000 requests, uniforms from CUDA's default generator.
    check_emitted_tokens_follow_the_target("native", 200_000, with_draft, CUDA)


def test_deterministic_when_seeded_on_cuda():
    check_deterministic_when_seeded("native", CUDA)


def test_mixed_greedy_and_random_batch_on_cuda():
    check_mixed_greedy_and_random_batch("native", CUDA)


def test_rejection_sampler_forward_on_cuda():
    check_rejection_sampler_forward_processes_the_target("native", 240_000, CUDA)


def test_no_host_sync_in_a_sampled_call():
    """A mixed, seeded, sampled batch raises nothing with synchronising calls forbidden (torch's sync debug mode)."""
    args = spread_batch([[1, 2, 3], [], [4, 5]], 1000, CUDA)
    meta = sampling_metadata([1.0, 0.0, 0.8], {2: torch.Generator(device=CUDA).manual_seed(1)}, device=CUDA)
    shim.rejection_sample(*args, meta)  # warm-up: first-call allocations
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = shim.rejection_sample(*args, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (3, 4)


def test_placeholder_drafts_on_cuda_without_host_sync():
    """Placeholder drafts (-1) rejected as vLLM rejects them, greedy and random, with synchronising calls forbidden:
    greedy rows emit the argmax at the placeholder, a random one (target one-hot at 7 there) the recovered 7."""
    ids, counts, k, cu = flat([[1, 2], [P], [], [3, P, 5, P]], CUDA)
    greedy_args = (ids, counts, k, cu, None, argmax_rows([1, 2, 7, 3, 9, 5, 6], 64, CUDA),
                   bonus_ids([10, 11, 12, 13], CUDA), sampling_metadata(device=CUDA))
    vocab = 100
    ids, counts, k, cu = flat([[1, vocab - 1, P], [4, P]], CUDA)
    target = torch.zeros(5, vocab, device=CUDA)
    target[torch.arange(5), torch.tensor([1, vocab - 1, 7, 6, 3])] = 1.0
    meta = sampling_metadata([1.0, 0.0], {0: torch.Generator(device=CUDA).manual_seed(0)}, device=CUDA)
    random_args = (ids, counts, k, cu, None, target, bonus_ids([9, 9], CUDA), meta)
    shim.rejection_sample(*greedy_args), shim.rejection_sample(*random_args)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        greedy, random = shim.rejection_sample(*greedy_args), shim.rejection_sample(*random_args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert greedy.tolist() == [[1, 2, 10, P, P], [7, P, P, P, P], [12, P, P, P, P], [3, 9, P, P, P]]
    assert random.tolist() == [[1, vocab - 1, 7, P], [6, P, P, P]]  # request 1 greedy: the argmax 6 at position 0


def test_no_host_sync_in_forward():
    """RejectionSampler.forward (logits processing with top-k / top-p, the bonus sampler, rejection_sample) with
    synchronising calls forbidden."""
    meta, logits, sm = forward_batch(12, CUDA)
    module = shim.RejectionSampler(BonusSampler())
    module(meta, None, logits, sm)  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = module(meta, None, logits, sm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (12, 4)


def test_agrees_with_vllms_rejection_sampler():
    vllm_rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
    for drafts, argmaxes, bonus, expected in GREEDY_CASES.values():
        ids, counts, k, cu = flat(drafts, CUDA)
        target = argmax_rows(argmaxes, 64, CUDA)
        meta = sampling_metadata(device=CUDA)
        # Later vLLM releases take target logits here; the argmax, all a greedy batch reads, is the same.
        theirs = vllm_rs.rejection_sample(ids, counts, k, cu, None, target, bonus_ids(bonus, CUDA), meta)
        ours = shim.rejection_sample(ids, counts, k, cu, None, target, bonus_ids(bonus, CUDA), meta)
        assert torch.equal(ours, theirs) and ours.tolist() == expected
    # Sampled rows whose target is one-hot at the drafts: both accept everything, whatever the draws.
    drafts = [[3, 1, 4], [], [1, 5]]
    ids, counts, k, cu = flat(drafts, CUDA)
    one_hot = torch.zeros(ids.numel(), 64, device=CUDA)
    one_hot[torch.arange(ids.numel()), ids.long()] = 1.0
    meta = sampling_metadata([1.0, 0.5, 0.9], device=CUDA)
    bonus = bonus_ids([7, 8, 9], CUDA)
    takes_logits = "target_logits" in inspect.signature(vllm_rs.rejection_sample).parameters
    theirs = vllm_rs.rejection_sample(ids, counts, k, cu, None, one_hot * 1e4 if takes_logits else one_hot, bonus, meta)
    assert torch.equal(shim.rejection_sample(ids, counts, k, cu, None, one_hot, bonus, meta), theirs)


@pytest.mark.parametrize("controls", ["top_k", "top_p", "both"])
def test_no_host_sync_in_forward_at_a_large_vocabulary(controls, gen):
    """RejectionSampler.forward on a batch of 8 mixed requests at V = 32000 with synchronising calls forbidden, top-k
    and top-p each alone and together: the draft positions' processing (process_target_logits) runs them through
    reference.filter_logits, which read values back (bool(any()), int(max())) until the H200 run found it. Then the
    processed rows: greedy rows the plain softmax, sampled rows the largest logits' prefix (k of them under top-k
    alone), each a distribution, top-k alone as on the CPU."""
    from helpers.compat_vllm import spec_metadata  # here: the module's import list is shared with other tests' edits

    vocab, n = 32000, 8
    counts = [1 + b % 3 for b in range(n)]
    temperature = [0.0, 0.7, 1.0, 1.3, 0.0, 0.5, 0.9, 1.1]
    top_k = [0, 5, 50, 1000, 20, 0, 7, vocab] if controls != "top_p" else None
    top_p = [1.0, 0.9, 0.5, 0.95, 0.8, 0.7, 1.0, 0.99] if controls != "top_k" else None
    logits = torch.randn(sum(counts) + n, vocab, generator=gen) * 3
    ids = torch.randint(vocab, (sum(counts),), generator=gen, dtype=torch.int32)

    def batch(device):
        meta = sampling_metadata(temperature, device=device,
                                 top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32, device=device),
                                 top_p=None if top_p is None else torch.tensor(top_p, device=device))
        return spec_metadata(counts, ids.to(device), device), logits.to(device), meta

    meta, x, sm = batch(CUDA)
    module = shim.RejectionSampler(BonusSampler())
    module(meta, None, x, sm)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = module(meta, None, x, sm)
        probs = shim.process_target_logits(x[meta.target_logits_indices], counts, sm, meta.cu_num_draft_tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.sampled_token_ids.cpu()
    assert tokens.shape == (n, max(counts) + 1) and bool(((tokens == -1) | ((tokens >= 0) & (tokens < vocab))).all())
    probs = probs.cpu()
    rows = x[meta.target_logits_indices].cpu()
    owner = torch.repeat_interleave(torch.arange(n), torch.tensor(counts))
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(owner)))
    for row, b in enumerate(owner.tolist()):
        if temperature[b] == 0.0:
            torch.testing.assert_close(probs[row], rows[row].softmax(-1))
            continue
        kept = probs[row] > 0
        torch.testing.assert_close(probs[row][kept], (rows[row][kept] / temperature[b]).softmax(-1))
        if not bool(kept.all()):
            assert float(rows[row][kept].min()) > float(rows[row][~kept].max()), (row, b)
        k = 0 if top_k is None or top_k[b] >= vocab else top_k[b]
        p = 1.0 if top_p is None else top_p[b]
        if k:
            assert 1 <= int(kept.sum()) <= k and (p < 1.0 or int(kept.sum()) == k), (row, b, int(kept.sum()))
        if p < 1.0:  # the fewest largest entries whose mass (within the top k) reaches p, up to float32 rounding
            w = (rows[row].double() / temperature[b]).softmax(-1)
            if k:
                w = torch.where(rows[row] >= rows[row].topk(k).values[-1], w, 0.0)
            w = w / w.sum()
            mass = float(w[kept].sum())
            assert mass >= p - 1e-5 and mass - float(w[kept].min()) < p + 1e-5, (row, b, mass)
    if controls == "top_k":
        meta_cpu, x_cpu, sm_cpu = batch("cpu")
        want = shim.process_target_logits(x_cpu[meta_cpu.target_logits_indices], counts, sm_cpu,
                                          meta_cpu.cu_num_draft_tokens)
        assert torch.equal(probs > 0, want > 0)
        torch.testing.assert_close(probs, want)

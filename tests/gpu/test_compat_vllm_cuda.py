"""The vLLM shim on CUDA: the CPU module's checks (tests/helpers.py) with device="cuda" (greedy cases, K = 32, the
law of the emitted tokens, seeded requests through CUDA generators, mixed batches, RejectionSampler.forward's
processing), and, where vllm is importable, the same greedy and deterministic batches against vLLM's own rejection
sampler."""
import inspect

import pytest
import torch
from helpers import (GREEDY_CASES, BonusSampler, argmax_rows, bonus_ids, check_deterministic_when_seeded,
                     check_emitted_tokens_follow_the_target, check_greedy_case, check_k32,
                     check_mixed_greedy_and_random_batch, check_rejection_sampler_forward_processes_the_target, flat,
                     forward_batch, sampling_metadata, spread_batch)

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

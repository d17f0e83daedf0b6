"""The vLLM shim on CUDA: the CPU module's cases with device="cuda" (greedy cases, K = 32, the law of the emitted
tokens, seeded requests through CUDA generators, mixed batches, RejectionSampler.forward's processing), and, where
vllm is importable, the same greedy and deterministic batches against vLLM's own rejection sampler."""
import inspect

import pytest
import torch

from specdec_ext.compat import vllm as shim
from tests import test_compat_vllm as cpu

CUDA = "cuda"


@pytest.mark.parametrize("case", list(cpu.GREEDY_CASES))
def test_greedy_cases_on_cuda(case):
    cpu.test_greedy_cases("native", case, device=CUDA)


def test_k32_on_cuda(gen):
    cpu.test_k32("native", gen, device=CUDA)


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_probs", "point_proposals"])
def test_emitted_tokens_follow_the_target_on_cuda(with_draft):
    # The CPU module's power statement holds: the same 200,000 requests, uniforms from CUDA's default generator.
    cpu.test_emitted_tokens_follow_the_target("native", 200_000, with_draft, device=CUDA)


def test_deterministic_when_seeded_on_cuda():
    cpu.test_deterministic_when_seeded("native", device=CUDA)


def test_mixed_greedy_and_random_batch_on_cuda():
    cpu.test_mixed_greedy_and_random_batch("native", device=CUDA)


def test_rejection_sampler_forward_on_cuda():
    cpu.test_rejection_sampler_forward_processes_the_target("native", 240_000, device=CUDA)


def test_no_host_sync_in_a_sampled_call():
    """A mixed, seeded, sampled batch raises nothing with synchronising calls forbidden (torch's sync debug mode)."""
    args = cpu.spread_batch([[1, 2, 3], [], [4, 5]], 1000, CUDA)
    meta = cpu.sampling_metadata([1.0, 0.0, 0.8], {2: torch.Generator(device=CUDA).manual_seed(1)}, device=CUDA)
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
    meta, logits, sm = cpu.forward_batch(12, CUDA)
    module = shim.RejectionSampler(cpu.BonusSampler())
    module(meta, None, logits, sm)  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = module(meta, None, logits, sm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (12, 4)


def test_agrees_with_vllms_rejection_sampler():
    vllm_rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")
    for drafts, argmaxes, bonus, expected in cpu.GREEDY_CASES.values():
        ids, counts, k, cu = cpu.flat(drafts, CUDA)
        target = cpu.argmax_rows(argmaxes, 64, CUDA)
        meta = cpu.sampling_metadata(device=CUDA)
        # Later vLLM releases take target logits here; the argmax, all a greedy batch reads, is the same.
        theirs = vllm_rs.rejection_sample(ids, counts, k, cu, None, target, cpu.bonus_ids(bonus, CUDA), meta)
        ours = shim.rejection_sample(ids, counts, k, cu, None, target, cpu.bonus_ids(bonus, CUDA), meta)
        assert torch.equal(ours, theirs) and ours.tolist() == expected
    # Sampled rows whose target is one-hot at the drafts: both accept everything, whatever the draws.
    drafts = [[3, 1, 4], [], [1, 5]]
    ids, counts, k, cu = cpu.flat(drafts, CUDA)
    one_hot = torch.zeros(ids.numel(), 64, device=CUDA)
    one_hot[torch.arange(ids.numel()), ids.long()] = 1.0
    meta = cpu.sampling_metadata([1.0, 0.5, 0.9], device=CUDA)
    bonus = cpu.bonus_ids([7, 8, 9], CUDA)
    takes_logits = "target_logits" in inspect.signature(vllm_rs.rejection_sample).parameters
    theirs = vllm_rs.rejection_sample(ids, counts, k, cu, None, one_hot * 1e4 if takes_logits else one_hot, bonus, meta)
    assert torch.equal(shim.rejection_sample(ids, counts, k, cu, None, one_hot, bonus, meta), theirs)

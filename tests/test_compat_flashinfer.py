"""The FlashInfer shim (specdec_ext.compat.flashinfer) against FlashInfer's contract, on the CPU kernels and under the
emulator (the CUDA kernels' source): chain_speculative_sampling's documented example, FlashInfer's own test
statement, accumulation into the caller's counts, the law of the counts and of the emitted tokens, the RNG arguments;
the paged prefill wrapper against a float64 softmax over the gathered pages, with FlashInfer's masks, and its
refusals."""
import math

import pytest
import torch

from helpers.chi_square import chi_square_pvalue
from helpers.compat_backends import on
from helpers.compat_flashinfer import (
    DOCUMENTED_OUTPUT,
    check_flashinfer_statement,
    documented_example,
    flashinfer_case,
    flashinfer_masks,
    pack_segments,
    paged_batch,
    plan_and_run,
    reference_attention,
)
from helpers.verify_attention import TOLERANCE, rel_error
from specdec_ext import compat, ops
from specdec_ext.compat.flashinfer import BatchPrefillWithPagedKVCacheWrapper, sampling

BACKENDS = ["cpu", "sim"]
MAX_QO = ops.LIMITS["max_verify_queries"]


# ----- chain_speculative_sampling -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,seeds", [("cpu", 300), ("sim", 12)])
def test_documented_example_at_every_seed(backend, seeds):
    draft, ids, target = documented_example()
    with on(backend):
        for seed in range(seeds):
            out, accepted, emitted = sampling.chain_speculative_sampling(draft, ids, target, seed=seed * 7919,
                                                                         offset=seed)
            assert out.tolist() == DOCUMENTED_OUTPUT and accepted.tolist() == [1] and emitted.tolist() == [1], seed
            assert out.dtype == accepted.dtype == emitted.dtype == torch.int32
        gen = torch.Generator().manual_seed(5)
        for _ in range(seeds // 4):  # keys drawn from a generator, and from torch's default one
            assert sampling.chain_speculative_sampling(draft, ids, target,
                                                       generator=gen)[0].tolist() == DOCUMENTED_OUTPUT
            assert sampling.chain_speculative_sampling(draft, ids, target)[0].tolist() == DOCUMENTED_OUTPUT


CPU_CASES = [(b, v, k, o) for b in (1, 99) for v in (111, 32000) for k in (1, 3, 5, 7) for o in (False, True)]
SIM_CASES = [(1, 111, 1, True), (7, 111, 5, False), (3, 32000, 2, False), (2, 32000, 7, True)]


@pytest.mark.parametrize("backend,batch,vocab,k,onehot", [("cpu", *c) for c in CPU_CASES] +
                         [("sim", *c) for c in SIM_CASES])
def test_flashinfer_test_statement(backend, batch, vocab, k, onehot, gen):
    draft, ids, target, target_ids = flashinfer_case(gen, batch, k, vocab, onehot)
    # Counts start from arbitrary values: what the call returns is base + its counts, in the same tensors.
    base_acc = torch.randint(0, 1000, (batch,), generator=gen, dtype=torch.int32)
    base_emit = torch.randint(0, 1000, (batch,), generator=gen, dtype=torch.int32)
    acc_buf, emit_buf = base_acc.clone(), base_emit.clone()
    with on(backend):
        out, acc, emit = sampling.chain_speculative_sampling(draft, ids, target, acc_buf, emit_buf, seed=11, offset=3)
    assert acc is acc_buf and emit is emit_buf
    check_flashinfer_statement(out, acc - base_acc, emit - base_emit, ids, vocab, target_ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64], ids=str)
def test_counts_are_added_in_place(backend, count_dtype, gen):
    batch, k, vocab = 24, 4, 50
    draft, ids, target, _ = flashinfer_case(gen, batch, k, vocab, onehot=False)
    target[:, :k] = 0.5 * target[:, :k] + 0.5 * draft  # closer to the draft: counts spread over 0..k
    with on(backend):
        out1, acc1, emit1 = sampling.chain_speculative_sampling(draft, ids, target, seed=4, offset=9)
        again = sampling.chain_speculative_sampling(draft, ids, target, seed=4, offset=9)
        out2, acc2, emit2 = sampling.chain_speculative_sampling(draft, ids, target, seed=4, offset=10)
        acc_buf = torch.full((batch,), 7, dtype=count_dtype)
        emit_buf = torch.full((batch,), 3, dtype=count_dtype)
        for offset in (9, 10):
            out, acc, emit = sampling.chain_speculative_sampling(draft, ids, target, acc_buf, emit_buf, seed=4,
                                                                 offset=offset)
            assert acc is acc_buf and emit is emit_buf
    assert all(torch.equal(x, y) for x, y in zip(again, (out1, acc1, emit1)))  # one key and counter, one draw
    assert not torch.equal(acc1, acc2) or not torch.equal(out1, out2)  # a new offset, new draws
    assert torch.equal(acc_buf, 7 + acc1.to(count_dtype) + acc2.to(count_dtype))
    assert torch.equal(emit_buf, 3 + emit1.to(count_dtype) + emit2.to(count_dtype))
    assert torch.equal(out, out2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_equal_to_draft_accepts_every_draft(backend, gen):
    batch, k, vocab = 16, 5, 40
    draft, ids, _, _ = flashinfer_case(gen, batch, k, vocab, onehot=False)
    support = torch.randperm(vocab, generator=gen)[:3]  # the bonus row has 3 tokens of mass
    bonus = torch.zeros(batch, 1, vocab)
    bonus[..., support] = torch.tensor([0.2, 0.3, 0.5])
    with on(backend):
        out, acc, emit = sampling.chain_speculative_sampling(draft, ids, torch.cat([draft, bonus], 1), seed=1, offset=0)
    assert torch.equal(acc, torch.full((batch,), k, dtype=torch.int32)) and torch.equal(emit, acc)
    assert torch.equal(out[:, :k], ids) and torch.isin(out[:, k], support).all()


def test_count_laws_and_emitted_tokens_follow_the_target():
    """One round over K = 3 positions with fixed p_i, q_i (V = 5), drafts drawn from q_i, N = 200,000 rows, fixed seed.
    Counts: accepted must have mean sum_i a_i (a_i = sum_x min(p_i, q_i), the chance that draft i passes on its
    own), emitted mean a_0 + a_0 a_1 + a_0 a_1 a_2; each mean's standard error is below 0.004, so a shift of 0.03 (a
    swap of the two counts here moves them by 0.5; FlashInfer's second judgement of the rejected draft by ~0.3) fails
    at z > 7. Tokens: position i, reached when the drafts before it were emitted, must follow p_i (Pearson
    chi-square, 4 dof): with p ~ 0.2 a move of 1% of probability between two tokens gives a noncentrality of
    N_i * 2 * 0.01^2 / 0.2 >= 0.001 * 60,000 = 60 at the last position (critical value 23.5 at 1e-4): power ~1."""
    gen = torch.Generator().manual_seed(2024)
    n, k, vocab = 200_000, 3, 5
    p, q = torch.rand(k + 1, vocab, generator=gen) + 0.1, torch.rand(k, vocab, generator=gen) + 0.1
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    ids = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(k)], 1).int()
    out, acc, emit = sampling.chain_speculative_sampling(q.expand(n, k, vocab), ids, p.expand(n, k + 1, vocab),
                                                         seed=torch.arange(n), offset=torch.zeros(n, dtype=torch.int64))
    a = torch.minimum(p[:k], q).sum(-1).double()
    assert abs(acc.double().mean() - a.sum()) < 0.03
    assert abs(emit.double().mean() - (a[0] + a[0] * a[1] + a[0] * a[1] * a[2])) < 0.03
    assert int((emit == k).sum()) >= 60_000  # the sample size the stated power needs at the last position
    pvalues = []
    for i in range(k + 1):
        reached = emit.long() >= i
        counts = torch.bincount(out[reached, i].long(), minlength=vocab).double()
        pvalues.append(chi_square_pvalue(counts.unsqueeze(0), p[i].double().unsqueeze(0))[0])
    assert min(pvalues) > 1e-4, pvalues


def test_emulated_kernel_gives_the_cpu_counts(gen):
    """Through the shim, the two backends read the same seed and offset: equal acceptance decisions and counts (RNG
    contract); the resampled token may differ only where rounding puts a draw on a CDF boundary."""
    draft, ids, target, _ = flashinfer_case(gen, 12, 4, 300, onehot=False)
    target[:, :4] = 0.3 * target[:, :4] + 0.7 * draft
    seed, offset = torch.randint(0, 2**62, (12,), generator=gen), torch.arange(12)
    cpu = sampling.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    with compat.emulated():
        sim = sampling.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    assert torch.equal(cpu[1], sim[1]) and torch.equal(cpu[2], sim[2])
    assert (cpu[0] != sim[0]).sum() <= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_offset_and_generator(backend, gen):
    batch, k, vocab = 6, 3, 64
    draft, ids, target, _ = flashinfer_case(gen, batch, k, vocab, onehot=False)
    seeds = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen)
    offsets = torch.randint(0, 2**40, (batch,), generator=gen)
    def call(*a, **kw):
        return sampling.chain_speculative_sampling(*a, **kw)
    with on(backend):
        whole = call(draft, ids, target, seed=seeds, offset=offsets)
        for b in range(batch):  # row b depends on its own inputs, seed[b] and offset[b] only
            row = call(draft[b:b + 1], ids[b:b + 1], target[b:b + 1], seed=int(seeds[b]), offset=int(offsets[b]))
            assert all(torch.equal(x[b:b + 1], y) for x, y in zip(whole, row)), b
        as_uint64 = call(draft, ids, target, seed=seeds.view(torch.uint64), offset=offsets.view(torch.uint64))
        assert all(torch.equal(x, y) for x, y in zip(whole, as_uint64))
        one = call(draft, ids, target, seed=seeds[:1], offset=offsets[:1])  # length 1: shared by every request
        assert all(torch.equal(x, y) for x, y in zip(one, call(draft, ids, target, seed=int(seeds[0]),
                                                               offset=int(offsets[0]))))
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        first, same = call(draft, ids, target, generator=g1), call(draft, ids, target, generator=g2)
        assert all(torch.equal(x, y) for x, y in zip(first, same))
        draws = {tuple(call(draft, ids, target, generator=g1)[0].flatten().tolist()) for _ in range(4)}
        assert len(draws | {tuple(first[0].flatten().tolist())}) > 1  # the generator advances on every call


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shared_seed_draws_independently_per_row(backend):
    """One seed for the batch (an int, or a tensor of 1 entry) must not give every row the same uniforms, as
    FlashInfer's
    rows each get their own subsequence: 64 identical rows whose one draft is always rejected (p = 0 at it) resample
    from a uniform target over 1000 tokens; equal keys would give one token 64 times, independent ones collide
    rarely (expected pairs 64 * 63 / 2 / 1000 ~ 2)."""
    batch, vocab = 64, 1000
    draft = torch.zeros(batch, 1, vocab)
    draft[..., 0] = 1.0
    ids = torch.zeros(batch, 1, dtype=torch.int32)
    target = torch.full((batch, 2, vocab), 1.0 / (vocab - 1))
    target[:, :, 0] = 0.0
    with on(backend):
        for seed, offset in ((5, 2), (torch.tensor([5]), torch.tensor([2]))):
            out, acc, emit = sampling.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
            assert torch.equal(emit, torch.zeros(batch, dtype=torch.int32))
            assert len(set(out[:, 0].tolist())) >= batch - 10, out[:, 0].tolist()


@pytest.mark.parametrize("kwargs,match", [
    ({"seed": 3}, "seed and offset go together"),
    ({"seed": 2**64, "offset": 0}, "seed must be an int that fits in 64 bits"),
    ({"offset": 3}, "seed and offset go together"),
    ({"seed": 3, "offset": torch.zeros(2, dtype=torch.int64)}, "both be tensors or both be ints"),
    ({"seed": torch.zeros(2, dtype=torch.int32), "offset": torch.zeros(2, dtype=torch.int64)}, "seed must be a 1-D "
                                                                                               "int64"),
    ({"seed": torch.zeros(2, dtype=torch.int64), "offset": torch.zeros(3, dtype=torch.int64)}, "offset must be a 1-D"),
    ({"seed": torch.zeros(2, 1, dtype=torch.int64), "offset": torch.zeros(2, dtype=torch.int64)}, "seed must be"),
    ({"maybe_output_accepted_token_num": torch.zeros(3, dtype=torch.int32)}, "maybe_output_accepted_token_num"),
    ({"maybe_output_emitted_draft_token_num": torch.zeros(2)}, "maybe_output_emitted_draft_token_num"),
])
def test_bad_rng_and_count_arguments_are_named(kwargs, match, gen):
    draft, ids, target, _ = flashinfer_case(gen, 2, 2, 10, onehot=False)
    with pytest.raises(ValueError, match=match):
        sampling.chain_speculative_sampling(draft, ids, target, **kwargs)


def test_bad_shapes_are_named(gen):
    draft, ids, target, _ = flashinfer_case(gen, 2, 3, 10, onehot=False)
    cases = [((draft[0], ids, target), "draft_probs"), ((draft, ids[:, :2], target), "draft_token_ids"),
             ((draft, ids, target[:, :3]), "target_probs"), ((draft, ids, target[..., :9]), "target_probs"),
             ((None, ids, target), "draft_probs"), ((draft, ids[0], target), "draft_token_ids")]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            sampling.chain_speculative_sampling(*args)


# ----- BatchPrefillWithPagedKVCacheWrapper --------------------------------------------------------------------------
PAGE, HQ, HKV, D = 8, 4, 2, 64


# Every combination on the CPU kernel; under the emulator the tuple form with two of the masks.
WRAPPER_CASES = [(backend, layout, form, mask) for backend in BACKENDS for layout in ("NHD", "HND")
                 for form in ("single", "tuple") for mask in ("causal", "full", "custom", "packed")
                 if backend == "cpu" or form == "single" or mask in ("causal", "custom")]


@pytest.mark.parametrize("backend,layout,cache_form,mask_kind", WRAPPER_CASES)
def test_wrapper_matches_reference(backend, layout, cache_form, mask_kind, gen):
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    # Ragged rows, a request with no rows, prefixes that leave the last page partly full and one exactly full.
    qo_lens, prefix_lens = [3, 0, 7, 1], [int(x) for x in torch.randint(0, 40, (3,), generator=gen)] + [PAGE * 3 - 1]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                                          dtype, layout)
    masks = flashinfer_masks(gen, mask_kind, qo_lens, kv_lens)
    kv = (cache[:, 0].contiguous(), cache[:, 1].contiguous()) if cache_form == "tuple" else cache
    with on(backend):
        wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), layout)
        out, lse = plan_and_run(wrapper, (q, kv, qo_indptr, kv_indptr, indices, last), PAGE, HQ, HKV, mask_kind, masks)
    ref, ref_lse = reference_attention(q, cache, layout, qo_indptr, kv_indptr, indices, masks, PAGE)
    assert rel_error(out, ref) <= TOLERANCE[dtype]
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_soft_cap_and_scales(backend, gen):
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    qo_lens, prefix_lens = [4, 6], [30, 3]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                                          dtype, "NHD")
    masks = flashinfer_masks(gen, "custom", qo_lens, kv_lens)
    sm_scale, q_scale, k_scale, v_scale = 0.2, 0.5, 1.5, 2.0
    with on(backend):
        wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD")
        wrapper.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, D, PAGE, custom_mask=torch.cat([m.reshape(-1) for m
                     in masks]), sm_scale=sm_scale, window_left=5, logits_soft_cap=3.0)
        out = wrapper.run(q, cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, window_left=5)
    ref, _ = reference_attention(q, cache, "NHD", qo_indptr, kv_indptr, indices, masks, PAGE,
                                 scale=sm_scale * q_scale * k_scale, window_left=5, soft_cap=3.0)
    assert rel_error(out, v_scale * ref) <= TOLERANCE[dtype]


def test_out_defaults_to_zeros_and_rows_past_the_batch_stay(gen):
    qo_lens, prefix_lens = [2, 3], [5, 9]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                                          torch.float32, "HND")
    q = torch.cat([q, torch.randn(2, HQ, D, generator=gen)])  # two rows no request owns
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "HND")
    wrapper.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, D, PAGE, causal=True)
    out = wrapper.run(q, cache)
    assert torch.equal(out[5:], torch.zeros(2, HQ, D)) and out[:5].isfinite().all()
    ref, _ = reference_attention(q, cache, "HND", qo_indptr, kv_indptr, indices,
                                 flashinfer_masks(gen, "causal", qo_lens, kv_lens), PAGE)
    assert rel_error(out[:5], ref[:5]) <= TOLERANCE[torch.float32]
    out2, lse2 = wrapper.run_return_lse(q, cache)
    assert torch.equal(out2, out) and lse2.dtype == torch.float32 and tuple(lse2.shape) == (7, HQ)


def test_largest_verify_block(gen):
    qo_lens, prefix_lens = [MAX_QO, 2], [13, 0]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                                          torch.float32, "NHD")
    masks = flashinfer_masks(gen, "custom", qo_lens, kv_lens)
    out, lse = plan_and_run(BatchPrefillWithPagedKVCacheWrapper(torch.empty(1)),
                            (q, cache, qo_indptr, kv_indptr, indices, last), PAGE, HQ, HKV, "packed", masks)
    ref, ref_lse = reference_attention(q, cache, "NHD", qo_indptr, kv_indptr, indices, masks, PAGE)
    assert rel_error(out, ref) <= TOLERANCE[torch.float32] and torch.allclose(lse.double(), ref_lse, atol=1e-3)


def test_cuda_graph_mode_copies_the_plan_into_the_buffers(gen):
    """use_cuda_graph=True: plan() writes the table into the caller's buffers and run() reads those very tensors,
    so that a captured run replays with the next plan; two plans of different shapes into the same buffers."""
    bufs = [torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.zeros(64, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32)]
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD", use_cuda_graph=True, qo_indptr_buf=bufs[0],
                                                  paged_kv_indptr_buf=bufs[1], paged_kv_indices_buf=bufs[2],
                                                  paged_kv_last_page_len_buf=bufs[3])
    assert wrapper.is_cuda_graph_enabled
    pointers = [b.data_ptr() for b in bufs]
    for qo_lens, prefix_lens, kind in (([3, 5, 2], [10, 0, 17], "custom"), ([1, 6, 4], [30, 2, 8], "full")):
        q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV,
                                                                              D, torch.float32, "NHD")
        masks = flashinfer_masks(gen, kind, qo_lens, kv_lens)
        out, _ = plan_and_run(wrapper, (q, cache, qo_indptr, kv_indptr, indices, last), PAGE, HQ, HKV, kind, masks)
        assert torch.equal(bufs[0], qo_indptr) and torch.equal(bufs[2][:indices.numel()], indices)
        ref, _ = reference_attention(q, cache, "NHD", qo_indptr, kv_indptr, indices, masks, PAGE)
        assert rel_error(out, ref) <= TOLERANCE[torch.float32]
    assert [b.data_ptr() for b in bufs] == pointers
    with pytest.raises(ValueError, match="qo_indptr_buf"):
        BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), use_cuda_graph=True)


def refusal_cases(gen):
    qo_lens, prefix_lens = [3, 2], [6, 4]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                                          torch.float32, "NHD")
    table = (qo_indptr, kv_indptr, indices, last, HQ, HKV, D, PAGE)
    masks = flashinfer_masks(gen, "custom", qo_lens, kv_lens)
    hides_prefix = [m.clone() for m in masks]
    hides_prefix[1][1, 2] = False
    def flat(ms):
        return torch.cat([m.reshape(-1) for m in ms])
    too_many = torch.tensor([0, MAX_QO + 1], dtype=torch.int32)
    plan_cases = [
        (dict(custom_mask=flat(hides_prefix)),
         "custom_mask hides KV position 2 of request 1's prefix from its query 1"),
        (dict(packed_custom_mask=pack_segments(hides_prefix)), "custom_mask hides"),
        (dict(custom_mask=flat(masks)[:-1]), "custom_mask has"),
        (dict(custom_mask=flat(masks).float()), "custom_mask must be a flat bool"),
        (dict(packed_custom_mask=pack_segments(masks)[:-1]), "packed_custom_mask has"),
        (dict(pos_encoding_mode="ROPE_LLAMA"), "pos_encoding_mode"),
        (dict(head_dim_vo=32), "head_dim_vo"),
        (dict(prefix_len_ptr=torch.zeros(2, dtype=torch.int32)), "prefix_len_ptr"),
        (dict(window_left=-2), "window_left"),
        (dict(seq_lens=torch.tensor([9, 7])), "seq_lens"),
    ]
    table_cases = [
        ((too_many, torch.tensor([0, 100], dtype=torch.int32), torch.arange(100, dtype=torch.int32),
          torch.tensor([1], dtype=torch.int32), HQ, HKV, D, 1), "qo_indptr gives request 0"),
        ((qo_indptr, kv_indptr, indices, torch.tensor([1, 1], dtype=torch.int32), HQ, HKV, D, PAGE), "query rows but "
                                                                                                     "a KV"),
        ((qo_indptr, kv_indptr, indices, torch.tensor([9, 1], dtype=torch.int32), HQ, HKV, D, PAGE),
         r"paged_kv_last_page_len\[0\] = 9"),
        ((qo_indptr, kv_indptr[:-1], indices, last, HQ, HKV, D, PAGE), "batch_size"),
        ((qo_indptr.float(), kv_indptr, indices, last, HQ, HKV, D, PAGE), "qo_indptr must be a 1-D int32"),
        ((qo_indptr, kv_indptr, indices[:2], last, HQ, HKV, D, PAGE), "paged_kv_indices"),
        ((qo_indptr, kv_indptr, indices, last, 3, HKV, D, PAGE), "num_qo_heads 3 must be a multiple"),
        ((qo_indptr, kv_indptr, indices, last, HQ, HKV, D, 0), "page_size"),
    ]
    return q, cache, table, plan_cases, table_cases


def test_refusals_name_the_argument(gen):
    q, cache, table, plan_cases, table_cases = refusal_cases(gen)
    for kwargs, match in plan_cases:
        with pytest.raises(ValueError, match=match):
            BatchPrefillWithPagedKVCacheWrapper(torch.empty(1)).plan(*table, **kwargs)
    for args, match in table_cases:
        with pytest.raises(ValueError, match=match):
            BatchPrefillWithPagedKVCacheWrapper(torch.empty(1)).plan(*args)
    for kwargs, match in ((dict(kv_layout="NDH"), "kv_layout"), (dict(backend="xla"), "backend"),
                          (dict(jit_args=[1]), "jit_args")):
        with pytest.raises(ValueError, match=match):
            BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), **kwargs)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1))
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(q, cache)
    wrapper.plan(*table, causal=True, window_left=4)
    small_pages = torch.zeros(cache.shape[0], 2, PAGE // 2, HKV, D)
    for args, kwargs, match in (((q, cache, 1.0), {}, "extra positional"), ((q, cache), {"sinks": torch.zeros(HQ)},
                                                                            "sinks"),
                                ((q, cache), {"window_left": 3}, "window_left 3 differs"),
                                ((q, cache[:, 0]), {}, "paged_kv_cache must be"),
                                ((q, small_pages), {}, "page_size 8"),
                                ((q[:, :2], cache), {}, "q must be"),
                                ((q, cache), {"k_scale": torch.ones(1)}, "k_scale must be a Python number"),
                                ((q, cache), {"return_lse": True, "lse": torch.zeros(3)}, "lse must be")):
        with pytest.raises(ValueError, match=match):
            wrapper.run(*args, **kwargs)


def graph_wrapper(batch, num_indices):
    bufs = [torch.zeros(n, dtype=torch.int32) for n in (batch + 1, batch + 1, num_indices, batch)]
    return BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD", use_cuda_graph=True, qo_indptr_buf=bufs[0],
                                               paged_kv_indptr_buf=bufs[1], paged_kv_indices_buf=bufs[2],
                                               paged_kv_last_page_len_buf=bufs[3])


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_int64_tables_are_range_checked_never_wrapped(gen, cuda_graph):
    """FlashInfer's plan takes int64 tables and the kernel reads int32: in range they give the int32 tables' result;
    a value outside int32's range is refused naming the table. Converted as it was, page 2**32 + p read page p and a
    qo_indptr offset by 2**32 passed for a valid one."""
    qo_lens, prefix_lens = [3, 2], [6, 12]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                                          torch.float32, "NHD")
    tables = {"qo_indptr": qo_indptr, "paged_kv_indptr": kv_indptr, "paged_kv_indices": indices,
              "paged_kv_last_page_len": last}
    make = (lambda: graph_wrapper(2, indices.numel())) if cuda_graph else \
        (lambda: BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD"))
    masks = flashinfer_masks(gen, "custom", qo_lens, kv_lens)
    want, _ = plan_and_run(make(), (q, cache, *tables.values()), PAGE, HQ, HKV, "custom", masks)
    got, _ = plan_and_run(make(), (q, cache, *(t.long() for t in tables.values())), PAGE, HQ, HKV, "custom", masks)
    assert torch.equal(got, want)
    for name, t in tables.items():
        for shift in (2**32, -2**32):  # each wraps back to the valid table
            wide = {k: v.long() for k, v in tables.items()}
            wide[name] = wide[name].clone()
            wide[name][-1] += shift
            assert torch.equal(wide[name].to(torch.int32), t)
            with pytest.raises(ValueError, match=f"plan: {name} holds values outside the int32 range"):
                make().plan(*wide.values(), HQ, HKV, D, PAGE, causal=True)
    page = indices.long().clone()
    page[0] = 2**32 + 1
    with pytest.raises(ValueError, match="paged_kv_indices holds values outside the int32 range"):
        make().plan(qo_indptr, kv_indptr, page, last, HQ, HKV, D, PAGE, causal=True)


def test_a_tree_mask_sees_exactly_its_ancestors(gen):
    """A direct check of the mask conversion: with V = I-like values, query i's output is the mean of the values
    it sees, so a wrongly placed column (a prefix/new-token split off by one) changes it."""
    qo_lens, prefix_lens = [4], [5]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, PAGE, 1, 1, D,
                                                                          torch.float32, "NHD")
    q.zero_()  # equal scores: the output is the mean of the visible values
    masks = flashinfer_masks(gen, "custom", qo_lens, kv_lens)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1))
    wrapper.plan(qo_indptr, kv_indptr, indices, last, 1, 1, D, PAGE, custom_mask=masks[0].reshape(-1))
    out = wrapper.run(q, cache)
    pos = torch.arange(kv_lens[0])
    values = cache[indices[pos // PAGE].long(), 1, pos % PAGE, 0]  # [S, D]
    want = torch.stack([values[masks[0][i]].mean(0) for i in range(4)])
    assert torch.allclose(out[:, 0], want, atol=1e-5)


def test_flashinfer_0_7_4_lse_base_and_layout(gen):
    """FlashInfer 0.7.4's run(lse_base, lse_layout): "ln" is the natural log, "HN" the contiguous [Hq, T] transpose,
    into a caller's buffer of that layout too; the output does not change."""
    qo_lens, prefix_lens = [2, 3], [5, 9]
    q, cache, qo_indptr, kv_indptr, indices, last, _ = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                                    torch.float32, "NHD")
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    wrapper.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, D, PAGE, causal=True, uniform_q_len=3)
    out, lse2 = wrapper.run(q, cache, return_lse=True)
    for base, factor in (("log2", 1.0), ("ln", math.log(2.0))):
        out_nh, nh = wrapper.run(q, cache, return_lse=True, lse_base=base)
        out_hn, hn = wrapper.run(q, cache, return_lse=True, lse_base=base, lse_layout="HN")
        assert torch.equal(out_nh, out) and torch.equal(out_hn, out)
        assert torch.allclose(nh, lse2 * factor) and hn.is_contiguous() and torch.equal(hn, nh.t())
        buf = torch.empty(HQ, 5)
        _, given = wrapper.run(q, cache, return_lse=True, lse_base=base, lse_layout="HN", lse=buf)
        assert given is buf and torch.equal(buf, hn)
    with pytest.raises(ValueError, match=f"lse must be a float32 tensor of shape \\({HQ}, 5\\)"):
        wrapper.run(q, cache, return_lse=True, lse_layout="HN", lse=torch.empty(5, HQ))


def test_flashinfer_0_7_4_arguments_accepted_or_refused(gen):
    """The arguments FlashInfer 0.7.0rc3 / 0.7.4 added: scheduling hints are accepted (the result does not depend on
    them), lossy or unsupported modes are refused naming the argument."""
    q, cache, table, _, _ = refusal_cases(gen)
    for backend in ("cute-dsl", "cute-dsl-prims"):
        BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), backend=backend)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1))
    wrapper.plan(*table, causal=True)
    want = wrapper.run(q, cache)
    got = wrapper.run(q, cache, use_fp16_softmax=True, uses_spcompress=False)
    assert torch.equal(got, want)
    for kwargs, match in ((dict(variant_owns_mask=True), "variant_owns_mask"),
                          (dict(max_total_num_rows=8), "max_total_num_rows requires use_cuda_graph")):
        with pytest.raises(ValueError, match=match):
            BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), **kwargs)
    for kwargs, match in ((dict(use_token_head_sf=True), "use_token_head_sf"),
                          (dict(uniform_q_len=2.5), "uniform_q_len")):
        with pytest.raises(ValueError, match=match):
            BatchPrefillWithPagedKVCacheWrapper(torch.empty(1)).plan(*table, **kwargs)
    for kwargs, match in ((dict(kv_cache_sf=(torch.ones(1), torch.ones(1))), "kv_cache_sf"),
                          (dict(skip_softmax_threshold_scale_factor=1.0), "skip-softmax"),
                          (dict(return_lse=True, lse_base="log10"), "lse_base"),
                          (dict(return_lse=True, lse_layout="TN"), "lse_layout")):
        with pytest.raises(ValueError, match=match):
            wrapper.run(q, cache, **kwargs)
    capped = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD", use_cuda_graph=True, max_total_num_rows=1,
                                                 qo_indptr_buf=torch.zeros(3, dtype=torch.int32),
                                                 paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32),
                                                 paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32),
                                                 paged_kv_last_page_len_buf=torch.zeros(2, dtype=torch.int32))
    qo_lens, prefix_lens = [2, 3], [5, 9]
    _, _, qo_indptr, kv_indptr, indices, last, _ = paged_batch(gen, qo_lens, prefix_lens, PAGE, HQ, HKV, D,
                                                               torch.float32, "NHD")
    with pytest.raises(ValueError, match="max_total_num_rows"):
        capped.plan(qo_indptr, kv_indptr, indices, last, HQ, HKV, D, PAGE, causal=True)

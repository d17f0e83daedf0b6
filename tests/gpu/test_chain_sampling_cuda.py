"""Chain speculative sampling on CUDA: the same tokens as the CPU kernel (bit-exact, by the canonical
order), no host synchronisation, capturable in a CUDA graph, defined output on invalid input."""
import re

import pytest
import torch

import specdec_ext


def case(batch, k, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2
    draft = logits[:, :k] + 0.7 * torch.randn(batch, k, vocab, generator=g)
    q = torch.softmax(draft, -1)
    ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, k).int()
    return {
        "ids": ids, "tl": logits.to(dtype), "dl": draft.to(dtype),
        "tp": torch.softmax(logits, -1).to(dtype), "dp": q.to(dtype),
        "nd": torch.randint(0, k + 1, (batch,), generator=g, dtype=torch.int32),
        "greedy": torch.rand(batch, generator=g) < 0.2,
        "temp": torch.where(torch.rand(batch, generator=g) < 0.2, 0.0, torch.rand(batch, generator=g) + 0.3),
        "seed": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=g),
        "offset": torch.randint(0, 2**40, (batch,), generator=g),
    }


def run(c, device, logits, with_draft):
    d = {k: v.to(device) for k, v in c.items()}
    if logits:
        return specdec_ext.chain_speculative_sampling_from_logits(
            d["ids"], d["tl"], d["dl"] if with_draft else None, temperature=d["temp"], num_draft_tokens=d["nd"],
            seed=d["seed"], offset=d["offset"])
    return specdec_ext.chain_speculative_sampling(d["ids"], d["tp"], d["dp"] if with_draft else None,
                                                  num_draft_tokens=d["nd"], greedy=d["greedy"], seed=d["seed"],
                                                  offset=d["offset"])


def assert_eager_and_replayed(call, out, cpu):
    """call() (already run once) wrote the CPU kernel's outputs into out; so does its CUDA graph's replay, whose capture
    must keep the launch and its workspace."""
    assert torch.equal(out[0].cpu(), cpu.output_token_ids) and torch.equal(out[1].cpu(), cpu.num_accepted)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out[0].fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0].cpu(), cpu.output_token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
# With 100-132 SMs, batch 1 splits each request over 32 blocks, 3 and 4 over 32 or 16, 17 over 4, 50 over 2, and 300
# runs one block per request (sampling_slices).
@pytest.mark.parametrize("batch,k,vocab", [(1, 1, 1), (3, 4, 1000), (300, 4, 3001), (17, 8, 32000), (4, 16, 128256),
                                           (2, 3, 262144), (50, 4, 20000)])
def test_cuda_matches_cpu_exactly(dtype, logits, with_draft, batch, k, vocab, strict):
    c = case(batch, k, vocab, dtype, batch * 7 + k + vocab)
    cpu = run(c, "cpu", logits, with_draft)
    gpu = run(c, "cuda", logits, with_draft)  # strict mode (the fixture): valid input records no error
    assert torch.equal(gpu.num_accepted.cpu(), cpu.num_accepted)
    assert torch.equal(gpu.output_token_ids.cpu(), cpu.output_token_ids)


@pytest.mark.parametrize("batch", [1, 50, 300])
def test_small_batches_split_each_request_over_blocks(batch):
    # Which instantiation ran, from the profiler's kernel names: chain_sampling_kernel<T, blocks per request>: the
    # largest power of two up to 32 with batch x blocks <= SMs (32 at batch 1, 2 at batch 50 on 100-132 SMs, 1 at 300).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    expected = next(s for s in (32, 16, 8, 4, 2, 1) if s == 1 or batch * s <= sms)
    c = case(batch, 4, 20000, torch.bfloat16, batch)
    cpu = run(c, "cpu", True, True)
    run(c, "cuda", True, True)  # warm-up: module load, occupancy query
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        gpu = run(c, "cuda", True, True)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        pytest.skip("the profiler recorded no kernels (CUPTI in use by another tool?)")
    launched = [re.search(r"chain_sampling_kernel<[^<>]+, (\d+)>", name) for name in kernels]
    assert [int(m.group(1)) for m in launched if m] == [expected], kernels
    assert torch.equal(gpu.output_token_ids.cpu(), cpu.output_token_ids)


@pytest.mark.parametrize("slices", [1, 2, 32])
@pytest.mark.parametrize("batch,vocab", [(1, 32000), (8, 128256)])
def test_every_forced_split_matches_cpu_and_replays_from_a_graph(slices, batch, vocab, monkeypatch, strict):
    # The benchmark's shapes with each request forced onto 1, 2 or 32 blocks (a cooperative launch above 1): the same
    # bits as the CPU kernel, eagerly and from a CUDA graph, whose capture must keep the launch and its workspace.
    monkeypatch.setenv("SPECDEC_SAMPLING_SLICES", str(slices))
    c = case(batch, 4, vocab, torch.float32, slices + batch)
    cpu = run(c, "cpu", True, True)
    d = {k: v.cuda() for k, v in c.items()}
    out = (torch.full((batch, 5), -7, dtype=torch.int32, device="cuda"), torch.full((batch,), -7, dtype=torch.int32,
                                                                                    device="cuda"))

    def call():
        specdec_ext.chain_speculative_sampling_from_logits(d["ids"], d["tl"], d["dl"], temperature=d["temp"],
                                                           num_draft_tokens=d["nd"], seed=d["seed"],
                                                           offset=d["offset"], out=out)

    call()
    assert_eager_and_replayed(call, out, cpu)


@pytest.mark.parametrize("batch,k,vocab", [(1, 4, 128256), (64, 8, 128256), (8, 4, 32000)])
def test_caller_normalizers_match_cpu_without_sync_and_replay_from_a_graph(batch, k, vocab):
    # The benchmark's logits+lse rows: logits_normalizer on CUDA gives the CPU's bits; the op with them returns the
    # CPU's tokens, makes no host sync and replays from a CUDA graph; strict mode checks them (none is off).
    c = case(batch, k, vocab, torch.bfloat16, batch + k)
    d = {key: v.cuda() for key, v in c.items()}
    t_rows, d_rows = c["temp"][:, None].expand(-1, k + 1), c["temp"][:, None].expand(-1, k)
    target_lse = specdec_ext.logits_normalizer(d["tl"], temperature=t_rows.cuda())
    draft_lse = specdec_ext.logits_normalizer(d["dl"], temperature=d_rows.cuda())
    cpu_target_lse = specdec_ext.logits_normalizer(c["tl"], temperature=t_rows)
    assert torch.equal(target_lse.cpu(), cpu_target_lse)
    cpu = specdec_ext.chain_speculative_sampling_from_logits(
        c["ids"], c["tl"], c["dl"], temperature=c["temp"], num_draft_tokens=c["nd"], seed=c["seed"],
        offset=c["offset"], target_lse=cpu_target_lse, draft_lse=draft_lse.cpu())
    out = (torch.full((batch, k + 1), -7, dtype=torch.int32, device="cuda"),
           torch.full((batch,), -7, dtype=torch.int32, device="cuda"))

    def call():
        specdec_ext.chain_speculative_sampling_from_logits(d["ids"], d["tl"], d["dl"], temperature=d["temp"],
                                                           num_draft_tokens=d["nd"], seed=d["seed"],
                                                           offset=d["offset"], out=out, target_lse=target_lse,
                                                           draft_lse=draft_lse)

    call()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_eager_and_replayed(call, out, cpu)
    specdec_ext.set_strict(True)
    try:
        call()
        with pytest.raises(ValueError, match="target_lse"):
            specdec_ext.chain_speculative_sampling_from_logits(d["ids"], d["tl"], d["dl"],
                                                               temperature=torch.ones_like(d["temp"]),
                                                               num_draft_tokens=torch.full_like(d["nd"], k),
                                                               seed=d["seed"], offset=d["offset"],
                                                               target_lse=target_lse + 0.05)
    finally:
        specdec_ext.set_strict(False)


def test_unaligned_rows_take_the_scalar_path():
    c = case(5, 3, 1001, torch.float32, 5)
    tp = torch.zeros(5, 4, 1002)
    tp[..., 1:] = c["tp"]
    dp = torch.zeros(5, 3, 1002)
    dp[..., 1:] = c["dp"]
    view_t, view_d = tp.cuda()[..., 1:], dp.cuda()[..., 1:]  # row starts 4 bytes past 16-byte alignment
    gpu = specdec_ext.chain_speculative_sampling(c["ids"].cuda(), view_t, view_d, seed=c["seed"].cuda())
    cpu = specdec_ext.chain_speculative_sampling(c["ids"], c["tp"], c["dp"], seed=c["seed"])
    assert torch.equal(gpu.output_token_ids.cpu(), cpu.output_token_ids)


def test_no_host_sync_and_cuda_graph_capture():
    c = {k: v.cuda() for k, v in case(64, 4, 32000, torch.bfloat16, 11).items()}
    out = (torch.empty(64, 5, dtype=torch.int32, device="cuda"), torch.empty(64, dtype=torch.int32, device="cuda"))
    step = torch.zeros(64, dtype=torch.int64, device="cuda")

    def call():
        specdec_ext.chain_speculative_sampling_from_logits(c["ids"], c["tl"], c["dl"], temperature=c["temp"],
                                                           seed=c["seed"], offset=step, out=out)

    call()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for s in range(3):
        step.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        want = specdec_ext.chain_speculative_sampling_from_logits(
            c["ids"].cpu(), c["tl"].cpu(), c["dl"].cpu(), temperature=c["temp"].cpu(), seed=c["seed"].cpu(), offset=s)
        assert torch.equal(out[0].cpu(), want.output_token_ids)


def test_invalid_input_defined_output_and_strict_mode():
    c = {k: v.cuda() for k, v in case(6, 3, 500, torch.float32, 3).items()}
    tp = c["tp"].clone()
    tp[2] = float("nan")
    ids = c["ids"].clone()
    ids[4, 0] = 10**6
    out = specdec_ext.chain_speculative_sampling(ids, tp, c["dp"], seed=c["seed"])
    toks, acc = out.output_token_ids.cpu(), out.num_accepted.cpu()
    for b in range(6):
        a = int(acc[b])
        if b == 2:  # every row NaN: nothing to sample, the last token is -1 (README)
            assert 0 <= a <= 3 and toks[b, a] == -1
            continue
        assert 0 <= a <= 3 and all(0 <= t < 500 for t in toks[b, : a + 1].tolist())
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match="target_probs holds NaN or inf.*draft_token_ids holds ids outside"):
            specdec_ext.chain_speculative_sampling(ids, tp, c["dp"], seed=c["seed"])
    finally:
        specdec_ext.set_strict(False)


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_opcheck_cuda(logits):
    c = {k: v.cuda() for k, v in case(3, 2, 77, torch.bfloat16, 1).items()}
    ops = torch.ops.specdec
    fn = ops.chain_speculative_sampling_from_logits if logits else ops.chain_speculative_sampling
    out = (torch.empty(3, 3, dtype=torch.int32, device="cuda"), torch.empty(3, dtype=torch.int32, device="cuda"))
    torch.library.opcheck(fn.default, (c["ids"], c["tl"] if logits else c["tp"], c["dl"] if logits else c["dp"],
                                       c["nd"],
                                       c["temp"].float() if logits else c["greedy"], c["seed"], c["offset"], *out,
                                       None))


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_omitted_greedy_and_offset_replay_from_a_cuda_graph(logits):
    """greedy (probabilities) and offset omitted while a CUDA graph is captured, as FlashInfer's
    chain_speculative_sampling calls the op (it never passes greedy): device constants (not greedy, Philox counter
    0), not a refused capture (the H200 run: the shim could not be captured). Each replay, with the seed tensor
    updated in place, gives the eager call's tokens on that seed (omitted or explicit) and the CPU kernel's."""
    batch, k = 32, 4
    c = {key: v.cuda() for key, v in case(batch, k, 32000, torch.bfloat16, 5).items()}
    seed = c["seed"].clone()
    out = (torch.empty(batch, k + 1, dtype=torch.int32, device="cuda"), torch.empty(batch, dtype=torch.int32,
                                                                                    device="cuda"))

    def call(d, seed, **explicit):
        if logits:
            return specdec_ext.chain_speculative_sampling_from_logits(d["ids"], d["tl"], d["dl"], temperature=d["temp"],
                                                                      seed=seed, **explicit)
        return specdec_ext.chain_speculative_sampling(d["ids"], d["tp"], d["dp"], seed=seed, **explicit)

    call(c, seed, out=out)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(c, seed, out=out)
    explicit = dict(offset=0) if logits else dict(offset=0, greedy=False)
    cpu = {key: v.cpu() for key, v in c.items()}
    for step in range(3):
        seed.copy_(c["seed"] + step)
        graph.replay()
        eager = call(c, seed.clone())
        assert torch.equal(out[0], eager.output_token_ids) and torch.equal(out[1], eager.num_accepted)
        assert torch.equal(out[0], call(c, seed.clone(), **explicit).output_token_ids)
        assert torch.equal(out[0].cpu(), call(cpu, seed.cpu(), **explicit).output_token_ids)

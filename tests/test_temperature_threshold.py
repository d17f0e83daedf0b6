"""Temperatures below LIMITS["min_temperature"] (0 included) are greedy, bit for bit, in the CPU kernel, the CUDA
kernel under the emulator and the reference, for the chain and the tree op; at and above it requests are sampled,
without losing their rows' mass for logits of any finite size; a temperature that is inf in float32 is an error
naming `temperature`. Inputs are random logits from fixed seeds, with ties at each row's max (three equal
maxima in half the requests), so that a sampled request visibly differs from a greedy one."""
import math

import pytest
import torch

import specdec_ext
from helpers.sampling_inputs import make_chain_inputs, make_tree_inputs
from specdec_ext import reference, sim
from specdec_ext.ops import LIMITS

BACKENDS = {"cpu": specdec_ext, "sim": sim}
T_MIN = LIMITS["min_temperature"]
F32_MAX = float(torch.finfo(torch.float32).max)
# Greedy: t = 0 and everything below the threshold, down to far below float32's smallest normal inverse.
BELOW = [1e-12, 1e-10, 1e-9, 1e-6, T_MIN * (1 - 1e-6)]
AT_OR_ABOVE = [T_MIN, 2 * T_MIN]
BATCH, K, N, VOCAB = 12, 3, 10, 1000


def add_ties(logits: torch.Tensor, gen: torch.Generator, requests) -> torch.Tensor:
    """Raises two more entries of every row of `requests` to the row's max: three equal maxima, of which greedy
    takes the first and sampling each with probability 1/3."""
    logits = logits.clone()
    for b in requests:
        for i in range(logits.shape[1]):
            row = logits[b, i]
            top = row.max()
            for j in torch.randperm(logits.shape[-1], generator=gen)[:2].tolist():
                row[j] = top
    return logits


def chain_inputs(seed: int, with_draft: bool, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    inp = make_chain_inputs(gen, BATCH, K, VOCAB, with_draft=with_draft)
    inp["target_logits"] = add_ties(inp["target_logits"] * scale, gen, range(0, BATCH, 2))
    if with_draft:
        inp["draft_logits"] = inp["draft_logits"] * scale
    # Drafts are often the target's first argmax, so that greedy and sampled acceptance both occur.
    argmax = inp["target_logits"][:, :K].argmax(-1).int()
    inp["ids"] = torch.where(torch.rand(BATCH, K, generator=gen) < 0.5, argmax, inp["ids"])
    return inp


def tree_inputs(seed: int, with_draft: bool, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    inp = make_tree_inputs(gen, BATCH, N, VOCAB, with_draft=with_draft)
    inp["target_logits"] = add_ties(inp["target_logits"] * scale, gen, range(0, BATCH, 2))
    if with_draft:
        inp["draft_logits"] = inp["draft_logits"] * scale
    return inp


def run(op, backend, inp, temperature):
    if op == "chain":
        return tuple(BACKENDS[backend].chain_speculative_sampling_from_logits(
            inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
            num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"]))
    return tuple(BACKENDS[backend].tree_speculative_sampling_from_logits(
        inp["parents"], inp["tokens"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        num_nodes=inp["num_nodes"], seed=inp["seed"], offset=inp["offset"]))


def run_reference(op, inp, temperature):
    if op == "chain":
        return reference.chain_speculative_sampling_from_logits(
            inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
            num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"])
    # (output_token_ids, accepted_nodes, num_accepted), as the op returns them
    return reference.tree_speculative_sampling_from_logits(
        inp["parents"], inp["tokens"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        num_nodes=inp["num_nodes"], seed=inp["seed"], offset=inp["offset"])


def inputs(op, seed, with_draft, scale=1.0):
    return (chain_inputs if op == "chain" else tree_inputs)(seed, with_draft, scale)


def assert_equal(a, b, what=""):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), what


def assert_matches_reference(op, out, ref):
    """The existing tests' rule: decisions agree but for rare float32 flips, the last token but for rare
    boundary cases (max(1, B // 50) rows each)."""
    allowed = max(1, BATCH // 50)
    if op == "chain":
        mismatched = (out[1] != ref[1]).sum().item() + (out[0] != ref[0]).any(-1).sum().item()
        assert mismatched <= allowed, (out, ref)
    else:
        assert (out[1] != ref[1]).any(-1).sum().item() <= allowed, (out, ref)
        assert (out[0] != ref[0]).any(-1).sum().item() <= allowed, (out, ref)


def differs(a, b) -> int:
    """Requests whose outputs differ."""
    return int(torch.stack([(x != y).reshape(BATCH, -1).any(-1) for x, y in zip(a, b)]).any(0).sum())


def test_the_threshold_is_one_float32_constant_everywhere():
    assert T_MIN == float(torch.tensor(1e-5, dtype=torch.float32))
    assert reference.MIN_TEMPERATURE == T_MIN and specdec_ext.ops.MIN_TEMPERATURE == T_MIN
    assert all(float(torch.tensor(t, dtype=torch.float32)) < T_MIN for t in BELOW)


@pytest.mark.parametrize("op", ["chain", "tree"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
def test_below_the_threshold_is_greedy_bit_for_bit(op, backend, with_draft):
    inp = inputs(op, 11, with_draft)
    greedy = run(op, backend, inp, 0.0)
    for t in BELOW:
        assert_equal(run(op, backend, inp, t), greedy, t)
    # Per request, as a [B] tensor: each request below the threshold is its own greedy result.
    mixed = torch.tensor([BELOW[b % len(BELOW)] if b % 3 else 0.0 for b in range(BATCH)], dtype=torch.float32)
    assert_equal(run(op, backend, inp, mixed), greedy)
    # ... which is the reference's greedy walk (exact: argmax decisions have no rounding to flip).
    assert_equal(run_reference(op, inp, BELOW[-1]), greedy)


@pytest.mark.parametrize("op", ["chain", "tree"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
@pytest.mark.parametrize("t", AT_OR_ABOVE, ids=["threshold", "twice"])
def test_at_and_above_the_threshold_is_sampled(op, backend, with_draft, t):
    inp = inputs(op, 12, with_draft)
    out = run(op, backend, inp, t)
    ref = run_reference(op, inp, t)
    assert_matches_reference(op, out, ref)
    # Sampled, not greedy: the tied rows draw among their three maxima.
    greedy = run(op, backend, inp, 0.0)
    assert differs(out, greedy) >= 1 and differs(ref, greedy) >= 1


@pytest.mark.parametrize("op", ["chain", "tree"])
def test_the_reference_agrees_at_the_boundary(op):
    # The reference decides on the temperature as the kernels read it, in float32: just below the threshold is
    # greedy; a Python float a few float32 ulps (9e-13) below it that rounds to it is sampled, like the threshold.
    inp = inputs(op, 13, True)
    greedy = run_reference(op, inp, 0.0)
    assert_equal(run_reference(op, inp, T_MIN * (1 - 1e-6)), greedy)
    rounds_up = T_MIN - 3e-13
    assert rounds_up < T_MIN and float(torch.tensor(rounds_up, dtype=torch.float32)) == T_MIN
    at = run_reference(op, inp, T_MIN)
    assert differs(at, greedy) >= 1
    assert_equal(run_reference(op, inp, rounds_up), at)
    for backend in BACKENDS:
        out = run(op, backend, inp, rounds_up)
        assert_equal(out, run(op, backend, inp, T_MIN))
        assert_matches_reference(op, out, at)


@pytest.mark.parametrize("op", ["chain", "tree"])
@pytest.mark.parametrize("scale", [1e3, 1e5, 1e30, 1e37], ids=str)
def test_huge_logits_at_the_threshold_keep_their_mass(op, scale, strict):
    # Logits of magnitude up to ~10 * scale (1e4 .. 1e38) at t = T_MIN: |logit| / t up to 1e43, far past float32.
    # The rows keep their max (no "no mass" on CPU, none recorded by the emulated kernel in strict mode), CPU and
    # the emulator agree bit for bit, and the tokens are in range; at 1e4 they also match the float64 reference.
    inp = inputs(op, 14, True, scale)
    assert bool(inp["target_logits"].isfinite().all()) and bool(inp["draft_logits"].isfinite().all())
    for t in (T_MIN, 1.0):
        cpu = run(op, "cpu", inp, t)
        assert_equal(run(op, "sim", inp, t), cpu)
        assert bool((cpu[0].gather(1, cpu[-1].long()[:, None]) >= 0).all())
        if scale <= 1e3:
            assert_matches_reference(op, cpu, run_reference(op, inp, t))


@pytest.mark.parametrize("op", ["chain", "tree"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
def test_strict_mode_around_the_threshold(op, with_draft, strict):
    # Strict mode checks every row on both backends and reads the emulated kernel's error word: valid requests
    # at every temperature around the threshold raise nothing, and the backends agree bit for bit.
    inp = inputs(op, 15, with_draft)
    greedy = run(op, "cpu", inp, 0.0)
    for t in [0.0, *BELOW, *AT_OR_ABOVE, F32_MAX]:
        cpu = run(op, "cpu", inp, t)
        assert_equal(run(op, "sim", inp, t), cpu, t)
        if t < T_MIN:
            assert_equal(cpu, greedy, t)


@pytest.mark.parametrize("op", ["chain", "tree"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_temperature_that_overflows_float32_is_an_error(op, backend):
    inp = inputs(op, 16, True)
    # Python numbers above the largest float32 (1e39 is inf in float32), lists of them, and the invalid ones.
    for t in (1e39, math.nextafter(F32_MAX, math.inf), 10**400, [1e39] * BATCH, math.inf, -1e-9, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            run(op, backend, inp, t)
    # The largest float32 is a temperature (sampled: nearly uniform).
    assert differs(run(op, backend, inp, F32_MAX), run(op, backend, inp, 0.0)) >= 1
    # A tensor's values are the kernels' to check: inf raises on CPU (it reads them) and, for the emulated CUDA
    # kernel, in strict mode; without it CUDA leaves a defined output (an invalid temperature is greedy).
    for t in (torch.full((BATCH,), math.inf), torch.full((BATCH,), 1e39, dtype=torch.float64)):
        if backend == "cpu":
            with pytest.raises(ValueError, match="temperature must be finite"):
                run(op, backend, inp, t)
        else:
            assert_equal(run(op, backend, inp, t), run(op, backend, inp, 0.0))
            specdec_ext.set_strict(True)
            try:
                with pytest.raises(ValueError, match="temperature must be finite"):
                    run(op, backend, inp, t)
            finally:
                specdec_ext.set_strict(False)

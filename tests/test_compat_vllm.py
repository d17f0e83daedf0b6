"""The vLLM shim (specdec_ext.compat.vllm): vLLM v1's rejection_sample cases, the law of the emitted tokens, seeded
requests, mixed greedy/random batches, RejectionSampler.forward's logits processing, the generation controls at the
draft positions (penalties counting the drafts, allowed-token masks, bad words across the drafts, min_tokens) and the
logprobs in each logprobs_mode against references written out from vLLM's code, parse_output, register() against a
stand-in vllm package and the plugin entry point, bad inputs. Every sampling case runs on the CPU kernel and on the
CUDA kernel's source under the emulator (smaller there, and checked equal to the CPU kernel on the same draws)."""
import ast
import importlib.metadata
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from helpers.chi_square import rows_chi_square_pvalue
from helpers.compat_backends import on
from helpers.compat_vllm import (
    GREEDY_CASES,
    LOGITS,
    BonusSampler,
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
    greedy_call,
    processed_law,
    sampling_metadata,
    spec_metadata,
)
from specdec_ext.compat import vllm as shim

# "native": specdec_ext's own kernels, chosen by the tensors' device (the CPU kernel here; tests/gpu runs the same
# checks with device="cuda"); "sim": the CUDA kernel's source under the emulator.
BACKENDS = ["native", "sim"]
P = shim.PLACEHOLDER_TOKEN_ID


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_cases(backend, case):
    check_greedy_case(backend, case, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_k32(backend, gen):
    check_k32(backend, gen, "cpu")


@pytest.mark.parametrize("backend,n", [("native", 200_000), ("sim", 500)])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_probs", "point_proposals"])
def test_emitted_tokens_follow_the_target(backend, n, with_draft):
    check_emitted_tokens_follow_the_target(backend, n, with_draft, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_when_seeded(backend):
    check_deterministic_when_seeded(backend, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_greedy_and_random_batch(backend):
    check_mixed_greedy_and_random_batch(backend, "cpu")


@pytest.mark.parametrize("backend,n", [("native", 240_000), ("sim", 240)])
def test_rejection_sampler_forward_processes_the_target(backend, n):
    check_rejection_sampler_forward_processes_the_target(backend, n, "cpu")


# A placeholder draft (-1) as vLLM's kernels treat it: rejected at its position (greedy: -1 never equals the argmax;
# random: a draft id < 0 is rejected, vllm-project/vllm#46533), the argmax or the recovered token emitted there and
# nothing after it. Cases as GREEDY_CASES: (drafts, argmax at each draft position, bonus tokens, expected output).
PLACEHOLDER_GREEDY_CASES = {
    "placeholder_reached": ([[5, P, 7]], [5, 9, 7], [8], [[5, 9, P, P]]),
    "argmax_is_the_stand_in_id": ([[5, P, 7]], [5, 0, 7], [8], [[5, 0, P, P]]),
    "placeholder_first": ([[P, P]], [3, 4], [8], [[3, P, P]]),
    "rejected_before_it": ([[4, P, P]], [6, 1, 2], [8], [[6, P, P, P]]),
    "ragged_batch": ([[1, 2], [P], [], [3, P, 5, P]], [1, 2, 7, 3, 9, 5, 6], [10, 11, 12, 13],
                     [[1, 2, 10, P, P], [7, P, P, P, P], [12, P, P, P, P], [3, 9, P, P, P]]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(PLACEHOLDER_GREEDY_CASES))
def test_placeholder_drafts_are_rejected_greedy(backend, case):
    drafts, argmaxes, bonus, expected = PLACEHOLDER_GREEDY_CASES[case]
    marks = [0.0 if b % 2 else -1.0 for b in range(len(drafts))]  # greedy rows of a mixed batch, as vLLM marks them
    with on(backend):
        assert greedy_call(drafts, argmaxes, bonus).tolist() == expected
        assert greedy_call(drafts, argmaxes, bonus, metadata=sampling_metadata(marks)).tolist() == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft", [False, True], ids=["point_proposals", "draft_probs"])
def test_placeholder_draft_is_rejected_random(backend, with_draft):
    """vLLM's test_placeholder_draft_token_rejected_random: drafts [1, V - 1, -1], target one-hot at 1, V - 1, 7 (then
    the bonus 9): the drafts are accepted, the placeholder rejected, and the recovered token, from the target at its
    position (norm(max(p - q, 0)) with draft rows: q uniform there), is 7; the bonus never comes."""
    vocab = 100
    ids, counts, k, cu = flat([[1, vocab - 1, P]])
    target = torch.zeros(3, vocab)
    target[torch.arange(3), torch.tensor([1, vocab - 1, 7])] = 1.0
    draft = torch.cat([target[:2], torch.full((1, vocab), 1.0 / vocab)]) if with_draft else None
    meta = sampling_metadata([1.0], {0: torch.Generator().manual_seed(0)})
    with on(backend):
        out = shim.rejection_sample(ids, counts, k, cu, draft, target, bonus_ids([9]), meta)
    assert out.tolist() == [[1, vocab - 1, 7, P]]


@pytest.mark.parametrize("backend,n", [("native", 100_000), ("sim", 400)])
@pytest.mark.parametrize("with_draft", [False, True], ids=["point_proposals", "draft_probs"])
def test_placeholder_position_follows_the_recovered_law(backend, n, with_draft):
    """Requests [2, -1]: the draft 2 is accepted with probability 0.4 (p0(2) = 0.4, q0 one-hot at 2), the placeholder
    then rejected and its token drawn from p1 (point proposals) or norm(max(p1 - q1, 0)), nothing after it. Fixed
    seeds. Position 1 is reached in ~40,000 rows: with V = 6 and cells >= 0.05, moving 1% of probability between two
    cells is a noncentrality >= 40,000 * 2e-4 / 0.5 = 16 (power ~0.8 at 1e-4), and the op's own rejection of a stand-in
    id (0, p1(0) = 0.3) would move 30%. Under the emulator: the CPU kernel's tokens on the same draws."""
    vocab, x0 = 6, 2
    p0 = torch.full((vocab,), 0.12)
    p0[x0] = 0.4
    p1 = torch.tensor([0.3, 0.05, 0.25, 0.1, 0.2, 0.1])
    q1 = torch.tensor([0.1, 0.3, 0.05, 0.3, 0.05, 0.2])
    ids, counts, k, cu = flat([[x0, P]] * n)
    target = torch.stack([p0, p1]).repeat(n, 1)
    draft = torch.stack([torch.eye(vocab)[x0], q1]).repeat(n, 1) if with_draft else None
    def call():
        return shim.rejection_sample(ids, counts, k, cu, draft, target, bonus_ids([vocab - 1] * n),
                                             sampling_metadata([1.0] * n))
    torch.manual_seed(5)
    with on(backend):
        y = call()
    if backend == "sim":
        torch.manual_seed(5)
        assert torch.equal(y, call())
    assert (y[:, 2] == P).all() and (y[:, 0] >= 0).all() and (y < vocab).all()
    reached = y[:, 0] == x0  # a rejected x0 is replaced by another token
    assert ((y[:, 1] >= 0) == reached).all(), "a token at the placeholder exactly when x0 was accepted"
    if backend == "sim":
        assert reached.any() and not reached.all()
        return
    assert 38_000 < int(reached.sum()) < 42_000
    law = (p1 - q1).clamp_min(0) if with_draft else p1
    counts1 = torch.bincount(y[reached, 1].long(), minlength=vocab)
    support = law > 0
    assert (counts1[~support] == 0).all()
    assert rows_chi_square_pvalue(counts1[support].unsqueeze(0), (law[support] / law.sum()).unsqueeze(0)) > 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_bad_draft_ids_still_raise(backend, strict):
    """Ids outside [0, V) other than the placeholder still reach the op, which refuses them (the CPU kernel always,
    CUDA and the emulator in strict mode); placeholders alone pass, strict mode included."""
    vocab = 8
    def call(drafts):
        return shim.rejection_sample(*flat(drafts), None, argmax_rows([0] * sum(map(len, drafts)), vocab),
                                                    bonus_ids([0] * len(drafts)),
                                                    sampling_metadata([1.0] * len(drafts)))
    with on(backend):
        for drafts in ([[1, -2]], [[P, 3], [vocab]], [[2, P, -7]]):
            with pytest.raises(ValueError, match="draft_token_ids"):
                call(drafts)
        assert call([[P, 3], [4, P]])[:, 0].ge(0).all()


def test_processing_finds_each_rows_request_from_either_form_of_the_counts():
    """Ragged counts with requests without drafts: the rows' owners from cu_num_draft_tokens (the device path) and from
    the host list must give the same probabilities, each row processed with its own request's settings."""
    counts = [2, 0, 3, 0, 1]
    temperature, top_k, top_p = [0.5, 1.0, 2.0, 0.7, 0.0], [3, 8, 8, 2, 8], [1.0, 1.0, 0.6, 1.0, 1.0]
    meta = sampling_metadata(temperature, top_k=torch.tensor(top_k, dtype=torch.int32), top_p=torch.tensor(top_p))
    logits = LOGITS.expand(sum(counts), -1).clone()
    cu = torch.tensor(counts).cumsum(0).int()
    host = shim.process_target_logits(logits, counts, meta)
    device = shim.process_target_logits(logits, counts, meta, cu)
    assert torch.equal(host, device)
    owners = [b for b, k in enumerate(counts) for _ in range(k)]
    for row, b in enumerate(owners):
        if temperature[b] == 0.0:
            assert int(host[row].argmax()) == int(LOGITS.argmax())
        else:
            assert torch.allclose(host[row].double(), processed_law(LOGITS, temperature[b], top_k[b], top_p[b]),
                                  atol=1e-6), row


def test_forward_without_top_k_top_p_and_all_greedy():
    meta, logits, _ = forward_batch(6)
    sampler = BonusSampler()
    greedy = shim.RejectionSampler(sampler)(meta, None, logits, sampling_metadata()).sampled_token_ids
    # Every draft is 1, the argmax is 0: each request emits 0 once; the bonus is never reached.
    assert greedy.tolist() == [[0, P, P, P]] * 6
    torch.manual_seed(0)
    plain = shim.RejectionSampler(sampler)(meta, None, logits, sampling_metadata([1.0] * 6)).sampled_token_ids
    assert ((plain[:, 0] >= 0) & (plain[:, 0] < 8)).all()


# Generation controls at the draft positions and logprobs, as vLLM 0.14-0.19's V1 RejectionSampler applies them
# (vllm/v1/sample/rejection_sampler.py: apply_logits_processors, _get_logprobs_tensors): the references below are
# written out from that code, row by row, on tiny batches.
NEG = float("-inf")


def controls_metadata(temperature=None, *, outputs, prompts=None, penalties=None, allowed=None, bad_words=None,
                      min_toks=None, vocab, **extra):
    """vLLM's SamplingMetadata fields for the controls: prompts padded with V (vLLM's pad), penalties
    [(repetition, presence, frequency)] per request, allowed [B] lists of allowed ids (None: all), min_toks as
    MinTokensLogitsProcessor's."""
    batch = len(outputs)
    fields = dict(output_token_ids=[list(o) for o in outputs], spec_token_ids=None)
    if penalties is not None:
        width = max(len(q) for q in prompts)
        fields.update(no_penalties=False,
                      prompt_token_ids=torch.tensor([list(q) + [vocab] * (width - len(q)) for q in prompts]),
                      repetition_penalties=torch.tensor([r for r, _, _ in penalties]),
                      presence_penalties=torch.tensor([p for _, p, _ in penalties]),
                      frequency_penalties=torch.tensor([f for _, _, f in penalties]))
    if allowed is not None:
        mask = torch.zeros(batch, vocab, dtype=torch.bool)
        for b, ids in enumerate(allowed):
            if ids is not None:
                mask[b] = True
                mask[b, ids] = False
        fields["allowed_token_ids_mask"] = mask
    if bad_words is not None:
        fields["bad_words_token_ids"] = bad_words
    if min_toks is not None:
        fields["logitsprocs"] = types.SimpleNamespace(non_argmax_invariant=[MinTokensProcessor(min_toks)])
    fields.update(extra)
    return sampling_metadata(temperature, **fields)


def reference_controls(rows, drafts, meta, vocab, count_drafts=True):
    """vLLM's apply_logits_processors, one draft position at a time: row j of request b sees history
    output_b + drafts_b[:j] (count_drafts=False: output_b alone, the bug the shim must not have). Penalties, then the
    allowed-token mask, bad words, min_tokens; float32 as vLLM's torch path (x * (1 / r) above 0)."""
    out, t = rows.clone(), 0
    prompts = getattr(meta, "prompt_token_ids", None)
    processors = getattr(getattr(meta, "logitsprocs", None), "non_argmax_invariant", [])
    for b, request_drafts in enumerate(drafts):
        for j in range(len(request_drafts)):
            history = meta.output_token_ids[b] + (request_drafts[:j] if count_drafts else [])
            x = out[t]
            if not meta.no_penalties:
                prompt = set(prompts[b].tolist())
                r = meta.repetition_penalties[b]
                for v in range(vocab):
                    c = history.count(v)
                    if c > 0 or v in prompt:
                        x[v] = x[v] * (1.0 / r) if x[v] > 0 else x[v] * r
                    x[v] -= meta.frequency_penalties[b] * c
                    x[v] -= meta.presence_penalties[b] * (c > 0)
            if meta.allowed_token_ids_mask is not None:
                x[meta.allowed_token_ids_mask[b]] = NEG
            for word in meta.bad_words_token_ids.get(b, []):
                if len(word) <= len(history) + 1 and history[len(history) - len(word) + 1:] == word[:-1]:
                    x[word[-1]] = NEG
            for processor in processors:
                minimum, generated, stops = processor.min_toks.get(b, (0, [], set()))
                if len(generated) + j < minimum:
                    x[sorted(stops)] = NEG
            t += 1
    return out


def controls_case():
    """Four requests (one without drafts), V = 12: drafts that repeat tokens of the output and of each other, bad words
    completed by drafts (across the output / draft boundary too), one bad word the prompt would complete (vLLM
    matches output tokens only), min_tokens with two stop-token sets, an allowed-token list. Fixed-seed logits."""
    vocab = 12
    drafts = [[3, 3, 7], [], [2, 6, 2, 2], [5, 11, 4]]
    outputs = [[3, 5], [8], [], [9]]
    prompts = [[1, 2], [4], [6, 6, 2], [11]]
    penalties = [(1.3, 0.4, 0.6), (2.0, 0.5, 0.5), (1.0, 0.0, 0.0), (0.8, -0.3, 0.2)]
    bad_words = {0: [[5, 3, 9], [3, 3, 4], [5, 2], [8]], 2: [[6, 2]], 3: [[11, 5], [9, 5, 11, 1], [3, 5]]}
    # 0: [5, 2] bans 2 at row 0; [5, 3, 9] 9 at row 1; [3, 3, 4] 4 at row 2; [8] everywhere. 2: [6, 2] bans 2 at row 2
    # only (the prompt ends with 6 too: not matched). 3: [9, 5, 11, 1] bans 1 at row 2.
    min_toks = {0: (4, [3, 5], {10, 11}), 3: (2, [9], {0})}  # 0: rows 0, 1 ban 10 and 11; 3: row 0 bans 0
    allowed = [None, None, [0, 1, 2, 3, 4, 5, 6, 7], None]
    rows = 2.0 * torch.randn(sum(map(len, drafts)), vocab, generator=torch.Generator().manual_seed(7))
    return vocab, drafts, outputs, prompts, penalties, bad_words, min_toks, allowed, rows


CONTROLS = {
    "penalties": dict(penalties=True),
    "allowed_token_ids": dict(allowed=True),
    "bad_words": dict(bad_words=True),
    "min_tokens": dict(min_toks=True),
    "all": dict(penalties=True, allowed=True, bad_words=True, min_toks=True),
}


def controls_inputs(which, temperature=None, **extra):
    vocab, drafts, outputs, prompts, penalties, bad_words, min_toks, allowed, rows = controls_case()
    on_ = CONTROLS[which]
    meta = controls_metadata(temperature, outputs=outputs, prompts=prompts, vocab=vocab,
                             penalties=penalties if on_.get("penalties") else None,
                             allowed=allowed if on_.get("allowed") else None,
                             bad_words=bad_words if on_.get("bad_words") else None,
                             min_toks=min_toks if on_.get("min_toks") else None, **extra)
    return vocab, drafts, rows, meta


@pytest.mark.parametrize("which", list(CONTROLS))
def test_generation_controls_at_the_draft_positions_match_vllm(which):
    vocab, drafts, rows, meta = controls_inputs(which)
    ids, counts, _, cu = flat(drafts)
    got = shim.apply_generation_controls(rows.clone(), ids, counts, cu, meta)
    want = reference_controls(rows, drafts, meta, vocab)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (torch.isinf(got) != torch.isinf(want)).nonzero()
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, rows), "the case must change something"
    if which not in ("allowed_token_ids", "min_tokens"):  # these two do not read the history's tokens
        blind = reference_controls(rows, drafts, meta, vocab, count_drafts=False)
        assert not torch.equal(torch.isinf(blind), torch.isinf(want)) or not torch.allclose(blind, want)


def test_generation_controls_off_leave_the_rows_alone():
    vocab, drafts, rows, meta = controls_inputs("penalties")
    meta.no_penalties = True
    ids, counts, _, cu = flat(drafts)
    assert shim.apply_generation_controls(rows.clone(), ids, counts, cu, meta).equal(rows)
    meta.logitsprocs = types.SimpleNamespace(non_argmax_invariant=[MinTokensProcessor({0: (9, [], {1})}, False)])
    assert shim.apply_generation_controls(rows.clone(), ids, counts, cu, meta).equal(rows)  # vLLM 0.12-0.16


def control_rows(top, second, vocab=10, rows=4):
    """Target rows [rows, V]: top[i] at 2.0, second at 1.5, the rest -1.0 (a draft is the argmax unless a control
    moves it)."""
    x = torch.full((rows, vocab), -1.0)
    x[torch.arange(rows), torch.tensor(top)] = 2.0
    x[:, second] = 1.5
    return x


def greedy_forward(drafts, rows, meta):
    """RejectionSampler.forward on a greedy batch whose rows are `rows` (target rows of each request, then its bonus
    row, which the stand-in sampler answers with its argmax: 9 here)."""
    counts = [len(d) for d in drafts]
    layout, t = [], 0
    for k in counts:
        layout += [rows[t:t + k], torch.full((1, rows.shape[1]), -1.0).index_fill_(1, torch.tensor([9]), 3.0)]
        t += k
    meta_spec = spec_metadata(counts, flat(drafts)[0])
    return shim.RejectionSampler(BonusSampler())(meta_spec, None, torch.cat(layout), meta).sampled_token_ids.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_penalties_count_the_drafts(backend):
    """Each row's argmax is its draft 4 (2.0) until the drafts already accepted penalise it below 6 (1.5): frequency
    0.3 with 4 output once (1.7, then 1.4), presence 0.6 (2.0, then 1.4), repetition 1.5 (2.0, then 1.33); the
    prompt's 4 penalises row 0 of the last request (1.33). Without the drafts counted every draft would be accepted."""
    drafts = [[4, 4, 4], [4, 4], [4, 4], [4, 4]]
    rows = control_rows([4] * 9, 6, rows=9)
    meta = controls_metadata(None, outputs=[[4], [], [2], [1]], prompts=[[7], [7], [7], [4, 3]], vocab=10,
                             penalties=[(1.0, 0.0, 0.3), (1.0, 0.6, 0.0), (1.5, 0.0, 0.0), (1.5, 0.0, 0.0)])
    with on(backend):
        out = greedy_forward(drafts, rows, meta)
    assert out == [[4, 6, P, P], [4, 6, P, P], [4, 6, P, P], [6, P, P, P]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_bad_words_span_the_drafts(backend):
    """Output [1, 2], drafts [3, 4, 5]: the bad word [2, 3, 4] is completed by the first draft, so 4 is banned at
    row 1 and 6 comes instead. The second request's prompt would complete [2, 3] but vLLM matches the output tokens
    only: its drafts are all accepted, then the bonus token."""
    drafts = [[3, 4, 5], [3, 5]]
    rows = control_rows([3, 4, 5, 3, 5], 6, rows=5)
    meta = controls_metadata(None, outputs=[[1, 2], []], prompts=[[0], [2]], vocab=10,
                             bad_words={0: [[2, 3, 4], [7]], 1: [[2, 3]]})
    with on(backend):
        out = greedy_forward(drafts, rows, meta)
    assert out == [[3, 6, P, P], [3, 5, 9, P]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_allowed_token_ids_mask(backend):
    """Request 0 may not emit 4 (its second draft): 6 instead; request 1 may emit only 3, 5 and 8: at its last row
    neither the draft 7 (2.0) nor 6 (1.5) is allowed, so 8 (-0.5, the largest allowed logit there)."""
    drafts = [[3, 4], [3, 5, 7]]
    rows = control_rows([3, 4, 3, 5, 7], 6, rows=5)
    rows[4, 8] = -0.5
    meta = controls_metadata(None, outputs=[[], []], vocab=10,
                             allowed=[[0, 1, 2, 3, 5, 6, 7, 8, 9], [3, 5, 8]])
    with on(backend):
        out = greedy_forward(drafts, rows, meta)
    assert out == [[3, 6, P, P], [3, 5, 8, P]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_min_tokens_per_request_stop_sets(backend):
    """vLLM 0.17-0.19: request 0 (1 token out, min 3, stops {5}) may not stop at rows 0 and 1: its draft 5 is banned
    at row 0 (6 instead); request 1 (none out, min 2, stops {6}) keeps its 5 at row 0 and loses 6 at row 1; request 2
    (no min_tokens) accepts both."""
    drafts = [[5, 5], [5, 6], [5, 6]]
    rows = control_rows([5, 5, 5, 6, 5, 6], 7, rows=6)
    meta = controls_metadata(None, outputs=[[9], [], []], vocab=10, min_toks={0: (3, [9], {5}), 1: (2, [], {6})})
    with on(backend):
        out = greedy_forward(drafts, rows, meta)
    assert out == [[7, P, P], [5, 7, P], [5, 6, 9]]


class LogitsSampler:
    """Stands in for vLLM's Sampler as the V1 rejection sampler calls it: the bonus rows' argmax and, asked with
    max_num_logprobs=-1, the bonus rows' logits in the override's mode (raw: as given; processed: the stand-in's
    processing, minus 0.25). Records each call's (max_num_logprobs, override)."""

    def __init__(self, logprobs_mode):
        self.logprobs_mode = logprobs_mode
        self.calls = []

    def __call__(self, *, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        self.calls.append((sampling_metadata.max_num_logprobs, logprobs_mode_override))
        scores = None
        if sampling_metadata.max_num_logprobs is not None:
            scores = types.SimpleNamespace(logprobs=logits.float() - (0.25 if "processed" in logprobs_mode_override
                                                                      else 0.0))
        return types.SimpleNamespace(sampled_token_ids=logits.argmax(-1, keepdim=True).int(), logprobs_tensors=scores)


def reference_processed(rows, drafts, meta, vocab):
    """vLLM's processed target rows: the controls, then temperature (greedy rows: 1) and top-k."""
    x = reference_controls(rows, drafts, meta, vocab)
    t = 0
    for b, request_drafts in enumerate(drafts):
        for _ in request_drafts:
            temperature = float(meta.temperature[b])
            if temperature > 0:
                x[t] = x[t] / temperature
                k = int(meta.top_k[b])
                x[t][x[t] < x[t].sort(descending=True).values[k - 1]] = NEG
            t += 1
    return x


def reference_logprobs(num_logprobs, drafts, target_rows, bonus_rows, out, logits_mode, dense):
    """vLLM 0.14-0.19's _get_logprobs_tensors (dense) or 0.12-0.13's (emitted slots only), slot by slot: slot j of
    request b reads row first_b + j (clamped) of the layout [its draft rows, its bonus row]*; a -1 slot is scored as
    token 0; scores are the row (logits modes) or its log_softmax; then the token's score, the top scores, the rank."""
    layout, t = [], 0
    for b, request_drafts in enumerate(drafts):
        layout += [target_rows[t + i] for i in range(len(request_drafts))] + [bonus_rows[b]]
        t += len(request_drafts)
    ids, scores, ranks, first = [], [], [], 0
    for b, request_drafts in enumerate(drafts):
        for j, token in enumerate(out[b]):
            if token == P and not dense:
                continue
            token = max(token, 0)
            row = layout[min(first + j, len(layout) - 1)]
            s = row if logits_mode else torch.log_softmax(row, -1)
            top = sorted(range(len(s)), key=lambda v: -float(s[v]))[:num_logprobs]
            ids.append([token] + top)
            scores.append([float(s[token])] + [float(s[v]) for v in top])
            ranks.append(int((s >= s[token]).sum()))
        first += len(request_drafts) + 1
    return ids, scores, ranks


class OldVllmRejectionSampler:
    """vLLM 0.12-0.13's class as dense_logprobs_layout reads it: parse_output(..., return_cu_num_tokens)."""

    @staticmethod
    def parse_output(output_token_ids, vocab_size, discard_req_indices=(), return_cu_num_tokens=False):
        raise AssertionError("stand-in")


@pytest.mark.parametrize("dense", [True, False], ids=["dense_0.14", "emitted_0.12"])
@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_forward_logprobs_as_vllm(mode, dense, monkeypatch):
    """A mixed batch (greedy, and temperatures with top-k) under every control, with logprobs: the tokens come from
    the kernel on the controlled rows, and the LogprobsTensors equal vLLM's for those tokens: the raw target rows
    (raw modes, the controls not applied) or the processed ones, and the sampler's bonus-row logits, in the layout of
    the release (dense: 0.14-0.19; the emitted slots only: 0.12-0.13)."""
    monkeypatch.setattr(shim, "_vllm_rejection_sampler", None if dense else OldVllmRejectionSampler)
    num_logprobs = 3
    vocab, drafts, rows, meta = controls_inputs("all", [0.0, 0.8, 1.3, 0.5], max_num_logprobs=num_logprobs,
                                                top_k=torch.tensor([12, 5, 12, 6]))
    counts = [len(d) for d in drafts]
    bonus = 2.0 * torch.randn(len(drafts), vocab, generator=torch.Generator().manual_seed(8))
    layout, t = [], 0
    for b, k in enumerate(counts):
        layout += [rows[t:t + k], bonus[b:b + 1]]
        t += k
    logits = torch.cat(layout)
    poisoned = logits.clone()
    sampler = LogitsSampler(mode)
    torch.manual_seed(11)
    out = shim.RejectionSampler(sampler)(spec_metadata(counts, flat(drafts)[0]), None, logits, meta)
    assert torch.equal(logits, poisoned), "the caller's logits are left as they are"
    assert sampler.calls == [(-1, "processed_logits" if mode.startswith("processed") else "raw_logits")]
    tokens = out.sampled_token_ids.tolist()
    processed = reference_processed(rows, drafts, meta, vocab)
    # The kernel saw the processed rows: no emitted token is one a control banned at its position.
    t = 0
    for b, k in enumerate(counts):
        for j in range(min(k, sum(x != P for x in tokens[b]))):
            assert torch.isfinite(processed[t + j, tokens[b][j]]), (b, j, tokens[b])
        t += k
    target = processed if mode.startswith("processed") else rows
    bonus_rows = bonus - (0.25 if mode.startswith("processed") else 0.0)
    ids, scores, ranks = reference_logprobs(num_logprobs, drafts, target, bonus_rows, tokens, mode.endswith("logits"),
                                            dense)
    lp = out.logprobs_tensors
    assert lp.logprob_token_ids.dtype == torch.int32 and lp.logprob_token_ids.tolist() == ids
    assert torch.allclose(lp.logprobs, torch.tensor(scores), rtol=1e-5, atol=1e-5)
    assert lp.selected_token_ranks.tolist() == ranks
    kept, second = shim.RejectionSampler.parse_output(out.sampled_token_ids, vocab, (), lp if dense else None,
                                                      return_cu_num_tokens=not dense)
    assert [len(x) for x in kept] == [sum(x != P for x in row) for row in tokens]
    if dense:  # the model runner's filter keeps the emitted tokens' rows: each row's first id is its token
        assert [[r[0][0] for r in zip(*request)] for request in second] == kept


def test_forward_hands_the_kernel_the_controlled_probabilities(monkeypatch):
    """The random rows' target probabilities are softmax(controlled rows / temperature, top-k masked): captured at
    rejection_sample, against the reference."""
    vocab, drafts, rows, meta = controls_inputs("all", [0.0, 0.8, 1.3, 0.5], top_k=torch.tensor([12, 5, 12, 6]))
    counts = [len(d) for d in drafts]
    captured = {}

    def capture(*args):
        captured["target_probs"] = args[5]
        return torch.full((len(counts), max(counts) + 1), P, dtype=torch.int32)

    monkeypatch.setattr(shim, "rejection_sample", capture)
    layout, t = [], 0
    for k in counts:
        layout += [rows[t:t + k], torch.zeros(1, vocab).fill_(0.5)]
        t += k
    shim.RejectionSampler(BonusSampler())(spec_metadata(counts, flat(drafts)[0]), None, torch.cat(layout), meta)
    want = reference_processed(rows, drafts, meta, vocab).softmax(-1)
    assert torch.allclose(captured["target_probs"], want, rtol=1e-6, atol=1e-7)


def test_parse_output():
    out = torch.tensor([[5, 6, P], [P, P, P], [7, 300, P], [1, 2, 3]], dtype=torch.int32)
    tokens, cu = shim.RejectionSampler.parse_output(out, vocab_size=100)
    assert tokens == [[5, 6], [], [7], [1, 2, 3]] and cu is None
    tokens, cu = shim.RejectionSampler.parse_output(out, 100, discard_req_indices=[3], return_cu_num_tokens=True)
    assert tokens == [[5, 6], [], [7], []] and cu == [0, 2, 2, 3, 6]


class LogprobsTensorsLike:
    """vLLM 0.14-0.19's LogprobsTensors as parse_output uses it: filter(mask) keeps rows, tolists(cu) splits them."""

    def __init__(self, rows):
        self.rows = rows

    def filter(self, mask):
        return LogprobsTensorsLike([row for row, keep in zip(self.rows, mask.tolist()) if keep])

    def tolists(self, cu):
        return [self.rows[a:b] for a, b in zip(cu[:-1], cu[1:])]


def test_parse_output_with_logprobs_tensors():
    """vLLM 0.14-0.19's form: the second result is the kept tokens' logprob rows, split per request by the counts
    taken before discarding (a discarded request keeps its rows there, as vLLM's)."""
    out = torch.tensor([[5, 6, P], [P, P, P], [7, 300, P], [1, 2, 3]], dtype=torch.int32)
    rows = [f"row{i}" for i in range(out.numel())]  # one logprob row per output slot, flattened
    tokens, logprobs = shim.RejectionSampler.parse_output(out, 100, [3], LogprobsTensorsLike(rows))
    assert tokens == [[5, 6], [], [7], []]
    assert logprobs == [["row0", "row1"], [], ["row6"], ["row9", "row10", "row11"]]


class MinTokensProcessor:
    """vLLM's MinTokensLogitsProcessor as the shim reads it: min_toks {request: (min_tokens, output ids, stop ids)};
    0.17-0.19's has apply_with_spec_decode (it masks the draft positions), 0.12-0.16's does not."""

    def __init__(self, min_toks, spec_decode=True):
        self.min_toks = min_toks
        if spec_decode:
            self.apply_with_spec_decode = lambda *args: pytest.fail("the shim masks the draft positions itself")


@pytest.mark.parametrize("processor, expected", [
    (MinTokensProcessor({0: (5, [4, 4], {7, 3}), 2: (1, [], {9}), 9: (3, [], {1})}),  # 9: not in a batch of 3
     [(0, 5, 2, (3, 7)), (2, 1, 0, (9,))]),
    (MinTokensProcessor({}), []),  # nobody short of min_tokens: nothing is masked at the draft positions
    (MinTokensProcessor({0: (5, [], set())}), []),  # no stop tokens: nothing to mask (vLLM skips it)
    (MinTokensProcessor({0: (5, [], {7})}, spec_decode=False), []),  # 0.12-0.16: drafts are not masked
])
def test_min_tokens_requests_at_the_draft_positions(processor, expected):
    processors = types.SimpleNamespace(non_argmax_invariant=[processor])
    assert shim._min_tokens_requests(sampling_metadata([1.0] * 3, logitsprocs=processors), 3) == expected


def _v1_module(init, rejection_sample):
    return types.SimpleNamespace(RejectionSampler=type("RejectionSampler", (), {"__init__": init}),
                                 rejection_sample=rejection_sample)


def test_v1_contract_check_knows_the_releases_it_follows():
    def init(self, sampler):
        pass

    def sample_probs(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                     target_probs, bonus_token_ids, sampling_metadata):
        pass

    def sample_logits(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                      target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False):
        pass

    def sample_moved(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, target_logits,
                     draft_probs, bonus_token_ids, sampling_metadata):
        pass

    def init_from_config(self, sampler, spec_config):
        pass

    assert shim._v1_contract_differs(_v1_module(init, sample_probs)) is None  # 0.12-0.14
    assert shim._v1_contract_differs(_v1_module(init, sample_logits)) is None  # 0.16-0.19
    assert "rejection_sample takes" in shim._v1_contract_differs(_v1_module(init, sample_moved))
    assert "RejectionSampler takes" in shim._v1_contract_differs(_v1_module(init_from_config, sample_probs))


def good_args(device="cpu"):
    ids, counts, k, cu = flat([[1, 2], [3]], device)
    target = argmax_rows([1, 2, 3], 8, device)
    return dict(draft_token_ids=ids, num_draft_tokens=counts, max_spec_len=k, cu_num_draft_tokens=cu,
                draft_probs=target.clone(), target_probs=target, bonus_token_ids=bonus_ids([4, 5], device),
                sampling_metadata=sampling_metadata([1.0, 0.0]))


BAD = [
    ("draft_token_ids", lambda a: a["draft_token_ids"].view(1, 3)),
    ("num_draft_tokens", lambda a: [2, -1]),
    ("num_draft_tokens", lambda a: torch.tensor([2, 1])),
    ("num_draft_tokens", lambda a: [2, 2]),  # sums to 4, 3 drafts
    ("max_spec_len", lambda a: 1),
    ("max_spec_len", lambda a: 129),
    ("max_spec_len", lambda a: 2.0),
    ("cu_num_draft_tokens", lambda a: a["cu_num_draft_tokens"][:1]),
    ("cu_num_draft_tokens", lambda a: torch.tensor([1, 3], dtype=torch.int32)),  # not the cumsum of [2, 1]
    ("target_probs", lambda a: a["target_probs"][:2]),
    ("target_probs", lambda a: a["target_probs"].unsqueeze(0)),
    ("draft_probs", lambda a: a["draft_probs"][:, :4]),
    ("bonus_token_ids", lambda a: a["bonus_token_ids"][:1]),
    ("temperature", lambda a: sampling_metadata([1.0, 0.0, 1.0])),
    ("generators", lambda a: sampling_metadata([1.0, 0.0], {5: torch.Generator()})),
    ("all_greedy", lambda a: types.SimpleNamespace(temperature=None)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,corrupt", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_inputs_name_the_argument(backend, name, corrupt):
    args = good_args()
    with on(backend):
        shim.rejection_sample(**args)  # the unmodified call is valid
        key = name if name in args else "sampling_metadata"
        args[key] = corrupt(args)
        with pytest.raises(ValueError, match=name):
            shim.rejection_sample(**args)


def test_forward_refuses_a_long_spec_len():
    meta, logits, _ = forward_batch(3)
    too_long = types.SimpleNamespace(**{**vars(meta), "max_spec_len": 129})
    with pytest.raises(ValueError, match="max_spec_len"):
        shim.RejectionSampler(BonusSampler())(too_long, None, logits, sampling_metadata())


class VllmRejectionSampler(nn.Module):
    """Stands in for vLLM's own class (0.14-0.19's parse_output): records any call handed to it (none should be)."""
    calls = []

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler

    def forward(self, *args):
        VllmRejectionSampler.calls.append(args)
        return "vllm's output"

    @staticmethod
    def parse_output(output_token_ids, vocab_size, discard_req_indices=(), logprobs_tensors=None):
        raise AssertionError("stand-in")


class ModelRunnerV2RejectionSampler:
    """Another class of the same name (vLLM's model runner v2): another contract, never replaced."""


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """A vllm package tree in sys.modules with the attribute paths vLLM's worker uses; removed after the test."""
    tree = {
        "vllm": {}, "vllm.v1": {}, "vllm.v1.sample": {},
        "vllm.v1.sample.rejection_sampler": {"RejectionSampler": VllmRejectionSampler},
        "vllm.v1.worker": {},
        "vllm.v1.worker.gpu_model_runner": {"RejectionSampler": VllmRejectionSampler},
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler": {"RejectionSampler": ModelRunnerV2RejectionSampler},
        "not_vllm.runner": {"RejectionSampler": VllmRejectionSampler},
    }
    modules = {}
    for name, attrs in tree.items():
        modules[name] = types.ModuleType(name)
        vars(modules[name]).update(attrs)
        monkeypatch.setitem(sys.modules, name, modules[name])
    monkeypatch.setattr(shim, "_vllm_rejection_sampler", None)
    VllmRejectionSampler.calls = []
    return modules


def test_register_replaces_vllms_class_where_the_worker_looks(stand_in_vllm, monkeypatch, caplog):
    m = stand_in_vllm
    with caplog.at_level(logging.INFO, logger="specdec_ext.compat.vllm"):
        patched = shim.register()
    assert patched == ["vllm.v1.sample.rejection_sampler.RejectionSampler",
                       "vllm.v1.worker.gpu_model_runner.RejectionSampler"]
    assert m["vllm.v1.sample.rejection_sampler"].RejectionSampler is shim.RejectionSampler
    assert m["vllm.v1.worker.gpu_model_runner"].RejectionSampler is shim.RejectionSampler
    assert m["vllm.v1.worker.gpu.spec_decode.rejection_sampler"].RejectionSampler is ModelRunnerV2RejectionSampler
    assert m["not_vllm.runner"].RejectionSampler is VllmRejectionSampler
    assert [r.name for r in caplog.records] == ["specdec_ext.compat.vllm"]
    assert "gpu_model_runner" in caplog.records[0].getMessage()
    # Idempotent; a module that imported vLLM's class after the first call is patched by the next one.
    assert shim.register() == []
    late = types.ModuleType("vllm.v1.spec_decode.late")
    late.RejectionSampler = VllmRejectionSampler
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert shim.register() == ["vllm.v1.spec_decode.late.RejectionSampler"]
    assert m["vllm.v1.sample.rejection_sampler"].RejectionSampler is shim.RejectionSampler
    # What the model runner now builds samples every batch itself, logprobs and generation controls included.
    runner_cls = m["vllm.v1.worker.gpu_model_runner"].RejectionSampler
    meta, logits, _ = forward_batch(3)
    module = runner_cls(LogitsSampler("raw_logprobs"))
    wants_all = sampling_metadata(None, max_num_logprobs=2, bad_words_token_ids={b: [[0]] for b in range(3)},
                                  output_token_ids=[[], [], []],
                                  allowed_token_ids_mask=torch.zeros(3, 8, dtype=torch.bool))
    out = module(meta, None, logits, wants_all)
    assert out.sampled_token_ids.tolist() == [[4, P, P, P]] * 3  # 0, the argmax, is a bad word: 4 comes next
    assert out.logprobs_tensors.logprobs.shape == (12, 3)
    assert module(meta, None, logits, sampling_metadata()).sampled_token_ids.tolist() == [[0, P, P, P]] * 3
    assert VllmRejectionSampler.calls == []


def test_register_without_vllm_logs_and_does_nothing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    monkeypatch.setattr(shim, "_vllm_rejection_sampler", None)
    with caplog.at_level(logging.INFO, logger="specdec_ext.compat.vllm"):
        assert shim.register() == []
    assert len(caplog.records) == 1 and "not importable" in caplog.records[0].getMessage()
    assert shim._vllm_rejection_sampler is None


def test_the_plugin_entry_point_is_declared():
    """setup.py declares it (the source of truth); an installed distribution's metadata, when it has the group, too."""
    setup_py = Path(__file__).resolve().parents[1] / "setup.py"
    call = next(node for node in ast.walk(ast.parse(setup_py.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    entry_points = ast.literal_eval(next(kw.value for kw in call.keywords if kw.arg == "entry_points"))
    assert entry_points["vllm.general_plugins"] == ["specdec_ext = specdec_ext.compat.vllm:register"]
    name, value = (s.strip() for s in entry_points["vllm.general_plugins"][0].split("="))
    assert importlib.metadata.EntryPoint(name, value, "vllm.general_plugins").load() is shim.register
    installed = [e for e in importlib.metadata.distribution("specdec_ext").entry_points
                 if e.group == "vllm.general_plugins"]
    assert installed == [] or [(e.name, e.value) for e in installed] == [(name, value)]

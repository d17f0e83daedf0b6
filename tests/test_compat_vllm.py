"""The vLLM shim (specdec_ext.compat.vllm): vLLM v1's rejection_sample cases, the law of the emitted tokens, seeded
requests, mixed greedy/random batches, RejectionSampler.forward's logits processing, parse_output, register() against
a stand-in vllm package and the plugin entry point, bad inputs. Every sampling case runs on the CPU kernel and on the
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
    """vLLM 0.17-0.19's MinTokensLogitsProcessor as the shim inspects it: min_toks {request: (min, output, stops)}."""

    def __init__(self, min_toks, spec_decode=True):
        self.min_toks = min_toks
        if spec_decode:
            self.apply_with_spec_decode = lambda *args: None


@pytest.mark.parametrize("processor, expected", [
    (MinTokensProcessor({0: (5, [], {7})}), "min_tokens"),
    (MinTokensProcessor({}), None),  # nobody short of min_tokens: nothing is masked at the draft positions
    (MinTokensProcessor({0: (5, [], {7})}, spec_decode=False), None),  # 0.12-0.16: drafts are not masked
])
def test_min_tokens_at_the_draft_positions_is_left_to_vllm(processor, expected):
    processors = types.SimpleNamespace(non_argmax_invariant=[processor])
    assert shim._needs_vllm(sampling_metadata([1.0], logitsprocs=processors)) == expected


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


def test_forward_refuses_what_it_leaves_to_vllm_without_register(monkeypatch):
    monkeypatch.setattr(shim, "_vllm_rejection_sampler", None)
    meta, logits, _ = forward_batch(3)
    module = shim.RejectionSampler(BonusSampler())
    for field, value in (("max_num_logprobs", 0), ("no_penalties", False), ("bad_words_token_ids", {0: [[1]]}),
                         ("allowed_token_ids_mask", torch.zeros(3, 8, dtype=torch.bool))):
        with pytest.raises(NotImplementedError, match="penalties" if field == "no_penalties" else field):
            module(meta, None, logits, sampling_metadata([1.0] * 3, **{field: value}))
    too_long = types.SimpleNamespace(**{**vars(meta), "max_spec_len": 129})
    with pytest.raises(ValueError, match="max_spec_len"):
        module(too_long, None, logits, sampling_metadata())


class VllmRejectionSampler(nn.Module):
    """Stands in for vLLM's own class: records the calls handed to it."""
    calls = []

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler

    def forward(self, *args):
        VllmRejectionSampler.calls.append(args)
        return "vllm's output"


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
    # What the model runner now builds hands logprobs batches to vLLM's own class, and samples the rest itself.
    runner_cls = m["vllm.v1.worker.gpu_model_runner"].RejectionSampler
    meta, logits, _ = forward_batch(3)
    module = runner_cls(BonusSampler())
    wants_logprobs = sampling_metadata([1.0] * 3, max_num_logprobs=2)
    assert module(meta, None, logits, wants_logprobs) == "vllm's output"
    assert len(VllmRejectionSampler.calls) == 1 and VllmRejectionSampler.calls[0][3] is wants_logprobs
    assert module(meta, None, logits, sampling_metadata()).sampled_token_ids.tolist() == [[0, P, P, P]] * 3
    assert len(VllmRejectionSampler.calls) == 1


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

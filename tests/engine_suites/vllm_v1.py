"""vLLM Model Runner V1: vllm.v1.sample.rejection_sampler's RejectionSampler against specdec_ext.compat.vllm's, under
specdec_ext.compat.vllm.register().

vLLM's own tests of it run from the release's sdist: tests/v1/sample/test_rejection_sampler.py (with the helpers of
tests/v1/sample/utils.py), on the CPU, the same way as Model Runner V2's (vllm_v2.py): the release's vllm/ package
from its source tree (standins/vllm_loader.py) on vLLM's CPU platform (the tests' DEVICE), register() before the test
module imports RejectionSampler, so the tests build the shim's class. A generated check (test_register_v1.py) asserts
what register() swapped, and that the shim's class gives vLLM's own class's tokens and logprobs under penalties,
allowed-token masks, bad words and min_tokens with vLLM's own Sampler; the contract checks compare the shim's signatures
with the release's.

Claimed: 0.12 to 0.19 (0.20 on passes target logits where these take probabilities, and builds the sampler from the
speculative config).
"""
from pathlib import Path

from . import STANDINS, Source, Suite, contract, note, rewrite, write_conftest
from .vllm_v2 import CONFTEST

PROJECT = "vllm"
SHIM = "specdec_ext.compat.vllm"
SAMPLER = "vllm/v1/sample/rejection_sampler.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"  # where Model Runner V1 builds its RejectionSampler
TEST_FILE = "tests/v1/sample/test_rejection_sampler.py"
_ASKS_LOGPROBS = "max_num_logprobs=0,"
HELPERS = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/sample/__init__.py", "tests/v1/sample/utils.py")

_REGISTER_CHECK = '''"""Written by tests/engine_suites/vllm_v1.py: what register() swapped in this release's
Model Runner V1."""
import dataclasses
import inspect
from unittest.mock import Mock

import conftest
import numpy as np
import pytest
import torch
from specdec_ext.compat import vllm as shim
from vllm.v1.sample import rejection_sampler

P = shim.PLACEHOLDER_TOKEN_ID


def test_register_swapped_rejection_sampler():
    assert rejection_sampler.RejectionSampler is shim.RejectionSampler
    assert "vllm.v1.sample.rejection_sampler.RejectionSampler" in conftest.REGISTERED
    assert shim._vllm_rejection_sampler.__module__ == "vllm.v1.sample.rejection_sampler"


def _same(ours, theirs):
    if isinstance(ours, (tuple, list)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), (ours, theirs)
        for a, b in zip(ours, theirs):
            _same(a, b)
    elif isinstance(ours, np.ndarray):
        np.testing.assert_array_equal(ours, theirs)
    else:
        assert ours == theirs


def test_parse_output_as_vllms():
    """The model runner calls the swapped class's parse_output: its second result in this release's form (0.12-0.13:
    cumulative counts on request; 0.14 on: the kept tokens' LogprobsLists), equal to vLLM's own."""
    vllm_class = shim._vllm_rejection_sampler
    out = torch.tensor([[5, 6, P], [P, P, P], [7, 300, P], [1, 2, 3]], dtype=torch.int32)
    for discard in ((), [3]):
        _same(shim.RejectionSampler.parse_output(out, 100, discard), vllm_class.parse_output(out, 100, discard))
    if "logprobs_tensors" in inspect.signature(vllm_class.parse_output).parameters:
        from vllm.v1.outputs import LogprobsTensors

        n = out.numel()
        kwargs = {"logprobs_tensors": LogprobsTensors(torch.arange(2 * n).view(n, 2), torch.randn(n, 2),
                                                      torch.arange(n))}
    else:
        kwargs = {"return_cu_num_tokens": True}
    _same(shim.RejectionSampler.parse_output(out, 100, [3], **kwargs),
          vllm_class.parse_output(out, 100, [3], **kwargs))


def test_min_tokens_at_the_draft_positions_as_vllms():
    """A greedy request short of its min_tokens drafts its stop token: the swapped class emits what vLLM's own does
    (0.17 on, vLLM masks the stop token at the draft positions, so the draft is rejected; the shim masks it too)."""
    from test_rejection_sampler import create_sampling_metadata, create_spec_decode_metadata
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.sampler import Sampler, SamplerOutput

    stop = 7
    processor = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    processor.min_toks = {0: (5, [], {stop})}
    logits = torch.full((2, 16), -10.0)
    logits[0, stop], logits[0, 2], logits[1, 3] = 10.0, 5.0, 10.0  # argmax the stop token, then 2; row 1: 3
    metadata = dataclasses.replace(create_sampling_metadata(all_greedy=True),
                                   logitsprocs=LogitsProcessors([processor]))
    outputs = []
    for cls in (shim.RejectionSampler, shim._vllm_rejection_sampler):
        sampler = Mock(spec=Sampler)
        sampler.logprobs_mode = "raw_logprobs"
        sampler.return_value = SamplerOutput(sampled_token_ids=torch.tensor([[9]]), logprobs_tensors=None)
        output = cls(sampler)(create_spec_decode_metadata([[stop, 3]], logits), draft_probs=None,
                              logits=logits.clone(), sampling_metadata=metadata)
        outputs.append(output.sampled_token_ids.tolist())
    assert outputs[0] == outputs[1]
    masks_drafts = hasattr(MinTokensLogitsProcessor, "apply_with_spec_decode")
    assert outputs[0] == ([[2, P, P]] if masks_drafts else [[stop, 3, 9]])


def _controls_batch(max_num_logprobs):
    """A mixed batch (greedy, and temperatures with top-k) under penalties, an allowed-token mask, bad words (one
    completed across the output and the drafts) and min_tokens. Seven target rows: vLLM's top-k runs in torch below
    eight (Triton, which needs a GPU's compute units, from eight). The random rows peak (+30) at their drafts, so
    that both classes accept them whatever their randomness; the controls move the greedy rows' tokens."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    vocab = 32
    drafts = [[3, 3, 7], [5, 6], [], [2, 2]]
    peaks = [[3, 3, 7, 1], [5, 6, 8], [4], [2, 2, 13]]  # each request's rows: its drafts' then its bonus row
    counts = [len(d) for d in drafts]
    gen = torch.Generator().manual_seed(3)
    layout, target, bonus, row = [], [], [], 0
    for b, d in enumerate(drafts):
        x = torch.randn(len(d) + 1, vocab, generator=gen)
        x[torch.arange(len(d) + 1), torch.tensor(peaks[b])] += 30.0
        layout.append(x)
        target += range(row, row + len(d))
        bonus.append(row + len(d))
        row += len(d) + 1
    min_tokens = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    min_tokens.min_toks = {3: (5, [7, 7], {2})}  # request 3 may not stop with 2 yet: its draft 2 is rejected (0.17 on)
    fields = {f.name for f in dataclasses.fields(SamplingMetadata)}
    optional = dict(spec_token_ids=[list(d) for d in drafts])
    meta = SamplingMetadata(
        temperature=torch.tensor([0.0, 0.7, 1.3, 0.0]), all_greedy=False, all_random=False, top_p=None,
        top_k=torch.tensor([vocab, 5, vocab, vocab]), generators={}, max_num_logprobs=max_num_logprobs,
        no_penalties=False, prompt_token_ids=torch.tensor([[1, 3, vocab], [5, 8, 8], [0, vocab, vocab], [4, 4, 4]]),
        frequency_penalties=torch.tensor([0.4, 0.2, 0.0, 0.0]), presence_penalties=torch.tensor([0.3, -0.1, 0.5, 0.0]),
        repetition_penalties=torch.tensor([1.2, 1.1, 1.0, 1.4]), output_token_ids=[[3, 1], [6], [4, 4], [7, 7]],
        allowed_token_ids_mask=torch.zeros(4, vocab, dtype=torch.bool).index_fill_(1, torch.tensor([30]), True),
        bad_words_token_ids={0: [[1, 3, 3, 7]], 1: [[6, 5, 9]]}, logitsprocs=LogitsProcessors([min_tokens]),
        **{k: v for k, v in optional.items() if k in fields})
    spec = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32), num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(counts).cumsum(0).int(),
        cu_num_sampled_tokens=(torch.tensor(counts) + 1).cumsum(0).int(),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(row, dtype=torch.int32))
    return spec, torch.cat(layout), meta


@pytest.mark.parametrize("num_logprobs", [None, 0, 4])
@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_controls_and_logprobs_as_vllms(mode, num_logprobs):
    """Penalties, the allowed-token mask, bad words and min_tokens at the draft positions, and the logprobs in each
    logprobs_mode, with vLLM's own Sampler: the swapped class's tokens and LogprobsTensors are vLLM's own class's.
    0.12-0.13 are compared where their class does what later ones do (their raw modes scored the rows after the
    controls and the temperature, which were applied in place; 0.12 returned no logprobs for max_num_logprobs=0)."""
    from vllm.v1.sample.sampler import Sampler

    vllm_class = shim._vllm_rejection_sampler
    before_014 = "logprobs_tensors" not in inspect.signature(vllm_class.parse_output).parameters
    outputs = []
    for cls in (shim.RejectionSampler, vllm_class):
        spec, logits, meta = _controls_batch(num_logprobs)
        torch.manual_seed(0)
        outputs.append(cls(Sampler(mode))(spec, None, logits, meta))
    ours, theirs = outputs
    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    assert ours.sampled_token_ids[0, 2] != 7, "the bad word [1, 3, 3, 7] bans 7 after the drafts 3, 3"
    if hasattr(MinTokensLogitsProcessor, "apply_with_spec_decode"):  # 0.17 on: min_tokens at the draft positions
        assert ours.sampled_token_ids[3, 0] != 2
    if num_logprobs is None or (before_014 and (mode.startswith("raw") or num_logprobs == 0)):
        assert num_logprobs is not None or ours.logprobs_tensors is None
        return
    a, b = ours.logprobs_tensors, theirs.logprobs_tensors
    assert torch.equal(a.logprob_token_ids, b.logprob_token_ids)
    assert torch.equal(a.selected_token_ranks, b.selected_token_ranks)
    # The penalties round as the logits processing module does (x / r; one offset): 1 ulp from vLLM's at most.
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
'''


def sources(version: str) -> dict:
    return {"release": Source(PROJECT, version, ("vllm/*", TEST_FILE) + HELPERS)}


def adapt(trees: dict, version: str, out_dir: Path) -> list:
    """The test file runs as the release has it (its DEVICE is vLLM's current platform's, the CPU here); its helpers
    are importable as the release's `tests` package."""
    root = trees["release"]
    for name in HELPERS:
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((root / name).read_text())
    text = (root / TEST_FILE).read_text()
    if _ASKS_LOGPROBS in text:
        # 0.12's tests' metadata has max_num_logprobs=0, which 0.12's class reads as no logprobs (0.13 on, and the
        # shim: the sampled tokens' logprobs), and never reads them; their mock Sampler returns no bonus-row logits,
        # which those logprobs need. None asks for none, in every release.
        text = rewrite(text, [(_ASKS_LOGPROBS, "max_num_logprobs=None,")], f"{PROJECT} {version} {TEST_FILE}")
        note(out_dir, "the tests' unread max_num_logprobs=0 (0.12: no logprobs; the shim, as 0.13 on: the sampled "
                      "tokens') set to None")
    (out_dir / Path(TEST_FILE).name).write_text(text)
    (out_dir / "test_register_v1.py").write_text(_REGISTER_CHECK)
    write_conftest(out_dir, [STANDINS], CONFTEST.format(root=str(root)))
    sampler = str(root / SAMPLER)
    # The class is what register() swaps; vLLM's module-level rejection_sample is internal to it (0.16-0.19 pass it
    # target logits where the shim's takes probabilities) and is not replaced.
    checks = [
        *({"kind": "signature", "id": f"RejectionSampler.{m}", "file": sampler, "qualname": f"RejectionSampler.{m}",
           "shim": f"{SHIM}:RejectionSampler.{m}", "allow": {}} for m in ("__init__", "forward")),
        {"kind": "call", "id": "gpu_model_runner:RejectionSampler", "file": str(root / RUNNER), "caller": None,
         "callee": "RejectionSampler", "shim": f"{SHIM}:RejectionSampler"},
        {"kind": "signature", "id": "RejectionSampler.parse_output", "file": sampler,
         "qualname": "RejectionSampler.parse_output", "shim": f"{SHIM}:RejectionSampler.parse_output",
         "allow": {"return_cu_num_tokens": "keyword-only in the shim, whose fourth positional is 0.14-0.19's "
                                           "logprobs_tensors; 0.12-0.13's model runner passes it by keyword"}},
        {"kind": "call", "id": "gpu_model_runner:parse_output", "file": str(root / RUNNER), "caller": None,
         "callee": "parse_output", "shim": f"{SHIM}:RejectionSampler.parse_output"},
    ]
    note(out_dir, f"vllm {version}'s package runs from its source tree; its Triton kernels in Triton's interpreter")
    return ["test_register_v1.py", Path(TEST_FILE).name] + contract.write_checks(out_dir, checks)


SUITE = Suite(
    name="vllm_v1",
    project=PROJECT,
    versions=("0.12.0", "0.19.1"),
    sources=sources,
    adapt=adapt,
    deselected={
        "test_rejection_sampler.py::test_sample_recovered_tokens*":
            "vLLM's private sample_recovered_tokens kernel (its Triton recovery step), not the RejectionSampler",
    },
    budget={},
    minimum_passed=50,
    tests_from="vLLM's own tests of Model Runner V1's rejection sampler from the release's sdist, on the CPU, and "
               "the release's signatures",
)

"""vLLM Model Runner V2: vllm.v1.worker.gpu.spec_decode's rejection_sample and RejectionSampler against
specdec_ext.compat.vllm_v2, under specdec_ext.compat.vllm.register().

vLLM's own tests of them run from the release's sdist: tests/v1/spec_decode/test_rejection_sampler_utils.py
(rejection_sample: acceptance laws, greedy, placeholders, block verification, chunking, sharded draft logits) and
tests/v1/worker/test_gpu_rejection_sampler_{chunking,i64}.py (RejectionSampler around it). They run on the CPU:
the release's vllm/ package is served from its source tree (standins/vllm_loader.py: vLLM's own modules, executed, with
stand-ins only for what cannot load without its compiled parts), vLLM's Triton kernels (its sampler's, the Gumbel
draws the tests compare against) run in Triton's interpreter, and register() points rejection_sample and
RejectionSampler at the shim before the tests import them, so the patch path is what is tested. The test files are
rewritten only to run on the CPU (device "cuda" -> "cpu", the no-CUDA skips dropped). A generated check
(test_register_v2.py) asserts what register() swapped in the release's module tree, and the contract checks compare
the shim's signatures with the release's.

Claimed: 0.28 (the first whose RejectionSampler keeps pre-temperature draft logits, the shim's draft input) to 0.34.
"""
import re
from pathlib import Path

from . import STANDINS, Source, Suite, contract, note, rewrite, write_conftest

PROJECT = "vllm"
SHIM = "specdec_ext.compat.vllm_v2"
SPEC_DECODE = "vllm/v1/worker/gpu/spec_decode"
TEST_FILES = ("tests/v1/spec_decode/test_rejection_sampler_utils.py",
              "tests/v1/worker/test_gpu_rejection_sampler_chunking.py",
              "tests/v1/worker/test_gpu_rejection_sampler_i64.py")
# vLLM 0.28-0.33's name of rejection_sample's second parameter, 0.34's draft_logits_cache: the shim takes either
# name and either form there (a [max_num_reqs, K, V] tensor or a DraftLogitsCache).
RENAMED = {"draft_logits": "draft_logits_cache"}

# The adapted folder's conftest (vllm_v1.py's too): vLLM from the release's source tree, then register(), before any
# test module imports the names it swaps.
CONFTEST = '''
from pathlib import Path

import vllm_loader

FINDER = vllm_loader.install(Path({root!r}))

from specdec_ext.compat import vllm as specdec_vllm  # noqa: E402

REGISTERED = specdec_vllm.register()


def pytest_report_header(config):
    return [f"vllm {{getattr(__import__('vllm'), '__version__', '?')}} from the source tree {root!r}",
            f"register() replaced: {{', '.join(REGISTERED) or 'nothing'}}",
            f"stand-in modules: {{len(FINDER.stood_in)}}"]
'''

_REGISTER_CHECK = '''"""Written by tests/engine_suites/vllm_v2.py: what register() swapped in this release's
Model Runner V2."""
import types

import pytest

import conftest
from specdec_ext.compat import vllm_v2
from vllm.v1.worker.gpu.spec_decode import rejection_sampler, rejection_sampler_utils

BASE = rejection_sampler.RejectionSampler.specdec_ext_base


def test_register_swapped_rejection_sample():
    assert rejection_sampler_utils.rejection_sample is vllm_v2.rejection_sample
    assert rejection_sampler.rejection_sample is vllm_v2.rejection_sample
    assert f"{{vllm_v2.UTILS_MODULE}}.rejection_sample" in conftest.REGISTERED
    assert f"{{vllm_v2.SAMPLER_MODULE}}.rejection_sample" in conftest.REGISTERED


def test_register_swapped_rejection_sampler():
    cls = rejection_sampler.RejectionSampler
    assert cls is not BASE and issubclass(cls, BASE) and cls.__module__ == vllm_v2.__name__
    assert f"{{vllm_v2.SAMPLER_MODULE}}.RejectionSampler" in conftest.REGISTERED


def _spec_config(method):
    return types.SimpleNamespace(num_speculative_tokens=2, rejection_sample_method=method)


@pytest.mark.parametrize("method", {methods!r})
def test_lossy_method_refused(method):
    with pytest.raises(ValueError, match="lossy"):
        rejection_sampler.RejectionSampler(object(), _spec_config(method), "cpu")


def test_watermark_key_refused():
    with pytest.raises(ValueError, match="watermark"):
        rejection_sampler.RejectionSampler(object(), _spec_config("standard"), "cpu", watermark_key=1234)


def test_constructs_with_the_release_signature(monkeypatch):
    """(sampler, spec_config, device, *, watermark_key=None) reaches vLLM's constructor unchanged."""
    seen = {{}}

    def init(self, sampler, spec_config, device, *args, **kwargs):
        seen.update(sampler=sampler, spec_config=spec_config, device=device, args=args, kwargs=kwargs)

    monkeypatch.setattr(BASE, "__init__", init)
    sampler, spec = object(), _spec_config("standard")
    rejection_sampler.RejectionSampler(sampler, spec, "cpu", watermark_key=None)
    assert seen == {{"sampler": sampler, "spec_config": spec, "device": "cpu", "args": (), "kwargs": {{}}}}
'''

_FLY = "rejection_sample_method 'fly' (fly_window_size > 0, entropy-deferred rejection, lossy): refused by the shim"
_WATERMARK = "watermarking (contexts, watermarking, watermark_key): refused by the shim"
_LOGPROB_IDS = ("vLLM's per-request logprob token ids (SamplingParams, whose module needs msgspec, not installed with "
                "specdec_ext): logprobs are vLLM's sampler's work, which the shim leaves to it")
_GUMBEL_DRAFTS = ("CPU time: the drafts come from vLLM's gumbel_sample Triton kernel, 32768-200000 trials in Triton's "
                  "interpreter (one case ran over 17 minutes)")


# The statistical tests run VOCAB_SIZE x 10-20 trials of K + 1 rows of VOCAB_SIZE logits: at 4096, 5-8 GB of target
# logits and 4-7 GB of draft logits per test, sized for a GPU; at 1024 a sixteenth, with the same trials per bin.
_GPU_VOCAB, _CPU_VOCAB = "\nVOCAB_SIZE = 4096\n", "\nVOCAB_SIZE = 1024\n"


def sources(version: str) -> dict:
    return {"release": Source(PROJECT, version, ("vllm/*",) + TEST_FILES)}


def on_cpu(text: str, what: str) -> str:
    """vLLM's test text on the CPU: its CUDA device names, and its no-CUDA skips (a module-level skip, skipif marks
    on current_platform) made to pass."""
    replacements = [(old, '"cpu"') for old in ('"cuda"', '"cuda:0"') if old in text]
    if not replacements:
        raise ValueError(f"{what}: no CUDA device name to rewrite; the release's test text moved")
    text = rewrite(text, replacements, what)
    text = rewrite(text, [(m, "") for m in re.findall(r"\nif not torch\.cuda\.is_available\(\):\n    pytest\.skip\("
                                                      r"[^\n]*\n", text)] or [("", "")], what)
    for call, value in (("current_platform.is_cuda_alike()", "True"), ("current_platform.is_cuda()", "True"),
                        ("current_platform.is_xpu()", "False"),
                        # torch.cpu has no get_rng_state: the CPU generator's state is torch's default one
                        ("torch.get_device_module(device).get_rng_state()", "torch.get_rng_state()")):
        text = text.replace(call, value)
    return text


def adapt(trees: dict, version: str, out_dir: Path) -> list:
    root = trees["release"]
    args = []
    for name in TEST_FILES:
        target = out_dir / Path(name).name
        text = on_cpu((root / name).read_text(), f"{PROJECT} {version} {name}")
        if _GPU_VOCAB in text:
            text = rewrite(text, [(_GPU_VOCAB, _CPU_VOCAB)], f"{PROJECT} {version} {name}")
            note(out_dir, f"{Path(name).name}: VOCAB_SIZE 4096 -> 1024 (host memory; its statistical tests draw 10-20 "
                          "trials per vocabulary entry, so their trials per bin are unchanged)")
        target.write_text(text)
        args.append(target.name)
    sampler_source = (root / SPEC_DECODE / "rejection_sampler.py").read_text()
    methods = [m for m in ("synthetic", "fly") if f'"{m}"' in sampler_source] or ["synthetic"]
    (out_dir / "test_register_v2.py").write_text(_REGISTER_CHECK.format(methods=tuple(methods)))
    write_conftest(out_dir, [STANDINS], CONFTEST.format(root=str(root)))
    checks = [
        {"kind": "signature", "id": "rejection_sample", "file": str(root / SPEC_DECODE / "rejection_sampler_utils.py"),
         "qualname": "rejection_sample", "shim": f"{SHIM}:rejection_sample", "allow": {},
         "renamed": RENAMED},
        {"kind": "call", "id": "RejectionSampler:rejection_sample", "file": str(root / SPEC_DECODE /
                                                                                 "rejection_sampler.py"),
         "caller": None, "callee": "rejection_sample", "shim": f"{SHIM}:rejection_sample"},
    ]
    note(out_dir, f"vllm {version}'s package runs from its source tree; its Triton kernels in Triton's interpreter")
    return ["test_register_v2.py"] + args + contract.write_checks(out_dir, checks)


SUITE = Suite(
    name="vllm_v2",
    project=PROJECT,
    versions=("0.28.0", "0.34.0"),
    sources=sources,
    adapt=adapt,
    deselected={
        "test_rejection_sampler_utils.py::test_fly_requires_entropy_and_native_lookahead*": _FLY,
        "test_rejection_sampler_utils.py::test_fly_pending_window_preserves_recovery_position*": _FLY,
        "test_rejection_sampler_utils.py::test_chunked_requests_match_full_batch[*fly_window_size=2*]": _FLY,
        "test_rejection_sampler_utils.py::test_fly_entropy_from_logits_matches_probabilities*":
            "vLLM's private compute_fly_entropy (the lossy fly mode's entropy), not the rejection sample",
        "test_rejection_sampler_utils.py::test_synthetic_rejection_sample*":
            "rejection_sample_method 'synthetic' (set acceptance rates, lossy): refused by the shim",
        "test_rejection_sampler_utils.py::test_watermarked_*": _WATERMARK,
        "test_rejection_sampler_utils.py::test_repeated_*": _WATERMARK,
        "test_rejection_sampler_utils.py::test_all_nan_target_logits_in_range*":
            "all-NaN target rows: the shim documents them as invalid input (ValueError on the CPU, -1 on CUDA), where "
            "vLLM maps NaN to -inf and emits some in-range token",
        "test_gpu_rejection_sampler_chunking.py::test_logprob_token_ids_*": _LOGPROB_IDS,
        "test_gpu_rejection_sampler_chunking.py::test_get_logprobs_dims_with_only_token_ids": _LOGPROB_IDS,
    },
    budget={
        "test_rejection_sampler_utils.py::test_gumbel_drafted_rejection_sample_is_unbiased*": _GUMBEL_DRAFTS,
        "test_rejection_sampler_utils.py::test_multiround_rejection_sample_is_unbiased[*probabilistic_draft=True*]":
            _GUMBEL_DRAFTS,
        "test_gpu_rejection_sampler_i64.py::*":
            "host memory: 5 GB bf16 target logits or draft cache (int64 indexing past 2**31 entries, a GPU kernel's "
            "concern), plus the shim's float32 draft rows",
    },
    minimum_passed=50,
    tests_from="vLLM's own tests of Model Runner V2's rejection sampler from the release's sdist, on the CPU "
               "(vLLM's Triton kernels interpreted), and the release's signatures",
)

"""FlashInfer: flashinfer.sampling.chain_speculative_sampling and BatchPrefillWithPagedKVCacheWrapper (plan / run)
against specdec_ext.compat.flashinfer.

FlashInfer's sdists stopped shipping its tests after 0.4.0rc3 (0.4.0 on: a handful of unrelated files; the wheels
have none), so its own tests of these functions come from the newest release that ships them, 0.4.0rc3, whose
signatures the claimed releases extend (seed / offset, o_data_type, scale tensors, ...); each claimed release's own
source (flashinfer/sampling.py, flashinfer/prefill.py) is checked against the shim's signatures (contract.py).
"""
from pathlib import Path

from . import STANDINS, Source, Suite, contract, rewrite, write_conftest

PROJECT = "flashinfer-python"
TESTS_RELEASE = "0.4.0rc3"  # the newest release whose sdist ships tests/
TEST_FILES = ("tests/test_sampling.py", "tests/test_batch_prefill_kernels.py")
TESTS = ("test_sampling.py::test_chain_speculative_sampling",
         "test_batch_prefill_kernels.py::test_batch_prefill_with_paged_kv_cache",
         "test_batch_prefill_kernels.py::test_batch_prefill_with_tuple_paged_kv_cache",
         "test_batch_prefill_kernels.py::test_batch_prefill_with_paged_kv_cache_custom_mask",
         "test_batch_prefill_kernels.py::test_batch_prefill_with_paged_kv_cache_multi_item_scoring")
SHIM = "specdec_ext.compat.flashinfer"
# Parameters of the claimed releases that the shim takes another way.
ALLOW = {}


def sources(version: str) -> dict:
    return {"tests": Source(PROJECT, TESTS_RELEASE, TEST_FILES),
            "release": Source(PROJECT, version, ("flashinfer/sampling.py", "flashinfer/prefill.py"))}


def adapt(trees: dict, version: str, out_dir: Path) -> list:
    """FlashInfer's test files run on the CPU tensors the shim takes there: device "cuda:0" -> "cpu" (CUDA-graph
    cases are FlashInfer's own xfail); `import flashinfer` gets the stand-in package."""
    for name in TEST_FILES:
        text = (trees["tests"] / name).read_text()
        replacements = [('device="cuda:0"', 'device="cpu"')]
        if name.endswith("prefill_kernels.py"):
            replacements.append((".to(0)", '.to("cpu")'))
        (out_dir / Path(name).name).write_text(rewrite(text, replacements, f"{PROJECT} {TESTS_RELEASE} {name}"))
    write_conftest(out_dir, [STANDINS])
    release = trees["release"] / "flashinfer"
    wrapper = f"{SHIM}.prefill:BatchPrefillWithPagedKVCacheWrapper"
    checks = [
        {"kind": "signature", "id": "chain_speculative_sampling", "file": str(release / "sampling.py"),
         "qualname": "chain_speculative_sampling", "shim": f"{SHIM}.sampling:chain_speculative_sampling",
         "allow": ALLOW},
        *({"kind": "signature", "id": f"BatchPrefillWithPagedKVCacheWrapper.{m}", "file": str(release / "prefill.py"),
           "qualname": f"BatchPrefillWithPagedKVCacheWrapper.{m}", "shim": f"{wrapper}.{m}", "allow": ALLOW}
          for m in ("__init__", "plan", "run")),
    ]
    return list(TESTS) + contract.write_checks(out_dir, checks)


_REFUSED_ROPE = "RoPE inside attention (pos_encoding_mode ROPE_LLAMA): refused by the shim (apply it to q and k before)"
_VERIFY_BLOCK = ("more query rows per request than a verify block: the shim takes 0..128 rows whose KV includes them "
                 "(a verify step, not a prefill of a long prompt)")

SUITE = Suite(
    name="flashinfer",
    project=PROJECT,
    versions=("0.7.0rc3", "0.7.4"),
    sources=sources,
    adapt=adapt,
    deselected={
        "test_batch_prefill_kernels.py::test_batch_prefill_with_paged_kv_cache_multi_item_scoring*":
            "multi-item scoring (prefix_len_ptr, token_pos_in_items_ptr) with RoPE: both refused by the shim",
        "test_batch_prefill_kernels.py::*[*pos_encoding_mode=ROPE_LLAMA*]": _REFUSED_ROPE,
        "test_batch_prefill_kernels.py::*[*qo_len=577*]": _VERIFY_BLOCK,
        "test_batch_prefill_kernels.py::*[*kv_len=54,*qo_len=127*]": _VERIFY_BLOCK,
        "test_batch_prefill_kernels.py::*[*kv_len=97,*qo_len=127*]": _VERIFY_BLOCK,
    },
    budget={
        "test_sampling.py::test_chain_speculative_sampling[batch_size=989,*]":
            "host memory and CPU time: [989, K, V] float32 tensors (4 GB each at V = 128256); batches 1 and 99 run",
        "test_sampling.py::test_chain_speculative_sampling[batch_size=99,*vocab_size=128256]":
            "CPU time: batch 99 at V = 128256 (batch 1 at 128256, 99 at 111 and 32000 run)",
        "test_batch_prefill_kernels.py::*[batch_size=17,*]": "CPU time: batch sizes 17 and 128 (12 runs)",
        "test_batch_prefill_kernels.py::*[batch_size=128,*]": "CPU time: batch sizes 17 and 128 (12 runs)",
        "test_batch_prefill_kernels.py::*[*,kv_len=2048,*]": "CPU time: KV length 2048 (54, 97 and 512 run)",
        "test_batch_prefill_kernels.py::*[*,head_dim=256,*]": "CPU time: head_dim 256 (128 runs)",
    },
    minimum_passed=50,
    tests_from=f"FlashInfer's own tests from {PROJECT} {TESTS_RELEASE}'s sdist (the newest that ships them), "
               "and the claimed release's signatures",
)

"""The transformers shim on CUDA: the law of generate(assistant_model=..., do_sample=True) under patch() is the
target's processed law, the shim's exact call has the target's law at a 1%-bias power, torch.manual_seed reproduces
a call. Helpers, laws and the CPU module's checks from tests/helpers/ (compat_transformers, laws, chi_square)."""
import pytest
import torch

from helpers.chi_square import bias_power, law_pvalue
from helpers.compat_transformers import (
    ASSISTED_SAMPLING,
    GENERATE_SAMPLES,
    CountingOps,
    assisted_models,
    check_law_of_the_shims_call,
    check_torch_manual_seed_reproduces_generate,
    generate_counts,
)
from helpers.laws import exact_law
from specdec_ext import compat
from specdec_ext.compat import transformers as shim

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def restore_transformers():
    yield
    shim.unpatch()


def test_generate_law_under_patch_on_cuda(monkeypatch):
    """As the CPU test: 1,500 generate() calls on CUDA models, the first 3 tokens against the exact law, p > 1e-3,
    power >= 0.9 against a 5% shift between the two likeliest sequences (~0.01 against 1%)."""
    target, assistant = assisted_models(CUDA)
    law = exact_law(ASSISTED_SAMPLING["temperature"], ASSISTED_SAMPLING["top_k"], ASSISTED_SAMPLING["top_p"])
    counting = CountingOps(compat.backend())
    monkeypatch.setattr(shim, "backend", lambda: counting)
    with shim.patch():
        counts = generate_counts(target, assistant, GENERATE_SAMPLES, seed=2024, **ASSISTED_SAMPLING)
    assert len(counting.calls) >= GENERATE_SAMPLES
    pvalue, df = law_pvalue(counts, law)
    assert bias_power(law, GENERATE_SAMPLES, df, 0.05) >= 0.9
    assert pvalue > 1e-3, (pvalue, df)


def test_law_of_the_shims_call_on_cuda():
    """The CPU module's large-batch law test on CUDA tensors (50,000 rounds, power >= 0.99 against a 1% shift)."""
    check_law_of_the_shims_call(CUDA)


def test_torch_manual_seed_reproduces_generate_on_cuda():
    """The key is drawn from the CUDA default generator (torch.manual_seed seeds it): same seed, same tokens."""
    check_torch_manual_seed_reproduces_generate(CUDA)

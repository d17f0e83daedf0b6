"""The emulator extension itself: built as the test command says, and reporting kernel misuse as errors."""
import os

import pytest
import torch

from specdec_ext import sim


def test_emulator_build_matches_the_requested_sanitizer():
    # scripts/test.sh exports SPECDEC_SIM_ASAN=1: the emulated kernels must then really run under ASan.
    wanted = os.environ.get("SPECDEC_SIM_ASAN", "0") not in ("", "0")
    assert sim.build_info()["address_sanitizer"] == wanted


def test_emulated_launch_errors_surface_as_python_errors():
    # n so large that the output cannot be allocated: the launcher must fail cleanly, before any launch.
    with pytest.raises(ValueError, match="n must be"):
        torch.ops.specdec_sim.philox_uniform(torch.tensor([1]), torch.tensor([1]), 2**40)

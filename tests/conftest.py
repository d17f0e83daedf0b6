import os
import random
import tempfile
import zlib

import pytest
import torch

import specdec_ext

# Random inputs are drawn fresh on every run; the run's seed is printed in the header and can be replayed
# with SPECDEC_TEST_SEED=<seed>.
# The cost tables of adaptive k (specdec_ext.costs) go to a fresh directory per run, not the user's cache: no test
# depends on a table an earlier run measured. Child processes (the CLI tests) inherit it.
os.environ["SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-test-cache-")

# setdefault: worker processes (pytest -n) inherit the controller's seed, so one header line replays the whole run.
RUN_SEED = int(os.environ.setdefault("SPECDEC_TEST_SEED", str(random.SystemRandom().randrange(2**31))))


def pytest_report_header(config):
    return f"specdec test seed: SPECDEC_TEST_SEED={RUN_SEED}"


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the run seed and the test's id (fresh inputs per run, replayable)."""
    return torch.Generator().manual_seed(RUN_SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def strict():
    """specdec_ext.set_strict(True) for the test: device-side error checks raise (and synchronise)."""
    specdec_ext.set_strict(True)
    try:
        yield
    finally:
        specdec_ext.set_strict(False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """For modules of tiny models, whose forwards are dispatch overhead: with several intra-op threads on a busy
    machine each op can wait milliseconds for a descheduled thread (runtime 2-10x and erratic). The results do
    not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

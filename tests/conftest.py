import os
import random
import tempfile
import zlib

import pytest
import torch

import specdec_ext

# Random inputs are drawn fresh on every run; the run's seed is printed in the header and can be replayed
# with SPECDEC_TEST_SEED=<seed>.
# The cost tables of adaptive k (specdec_ext.cost_tables) go to a fresh directory per run, not the user's cache: no test
# depends on a table an earlier run measured. Child processes (the CLI tests) inherit it.
os.environ["SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-test-cache-")

# setdefault: worker processes (pytest -n) inherit the controller's seed, so one header line replays the whole run.
RUN_SEED = int(os.environ.setdefault("SPECDEC_TEST_SEED", str(random.SystemRandom().randrange(2**31))))

# Under pytest-xdist each worker runs torch on its share of the cores, and so do the processes it starts (the CLI
# tests, through OMP_NUM_THREADS): two workers of two intra-op threads each on two cores make every parallel op wait
# for a descheduled thread (measured 3x slower, and erratic). The results do not depend on the thread count.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    THREADS = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(THREADS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n N schedules by work stealing: each worker starts on one contiguous part of the suite (module fixtures and
    shared models built once per worker) and an idle worker takes half of a busy one's queue. xdist's default sends
    chunks of consecutive tests, so the law tests of one module (a minute each) could end the run on one worker while
    the other idles."""
    if config.getvalue("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None


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


@pytest.fixture(scope="session", autouse=True)
def shared_models_stay_unchanged():
    """The models helpers.models shares between tests (tiny_model, shipped_model) are read-only: checked at the end."""
    yield
    from helpers.models import assert_shared_models_unchanged  # here: the xdist controller never imports the models

    assert_shared_models_unchanged()


@pytest.fixture(params=["sse2", "avx2", "avx512"])
def isa(request, monkeypatch):
    """The CPU GEMM kernels forced to each instruction set in turn (SPECDEC_CPU_ISA); one the CPU lacks is skipped
    (AVX-512 runs only on a machine that has it)."""
    from specdec_ext import ops

    monkeypatch.setenv("SPECDEC_CPU_ISA", request.param)
    try:
        assert ops.cpu_isa() == request.param
    except ValueError as error:
        assert "lacks" in str(error)
        pytest.skip(f"this CPU has no {request.param}")
    return request.param

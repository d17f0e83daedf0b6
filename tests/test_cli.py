import subprocess
import sys

import torch

import specdec_ext


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "specdec_ext.cli", *args], capture_output=True, text=True, timeout=600)


def test_info_reports_the_build():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    info = specdec_ext.build_info()
    assert f"specdec_ext {specdec_ext.__version__}" in r.stdout
    if info["cuda"]:
        assert f"compiled for architectures {info['cuda_archs']}" in r.stdout
        assert info["cuda_archs"]
    else:
        assert "CPU-only build" in r.stdout
    assert "emulator: present" in r.stdout
    # The CPU kernels parallelise with at::parallel_for, which is serial unless the build has OpenMP.
    assert info["openmp"] and f"{torch.get_num_threads()} threads" in r.stdout


def test_demo_runs_and_checks_itself():
    r = run_cli("demo", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-exact with the PyTorch reference: True" in r.stdout
    assert "demo OK" in r.stdout
    # The shipped model answered through speculative decoding, with the same tokens as plain decoding.
    answer = r.stdout.split("assistant: ", 1)[1].split("\nplain decoding", 1)[0]
    assert "paris" in answer.lower(), answer
    assert "speculative tokens equal plain greedy decoding's: True" in r.stdout
    assert "speedup" in r.stdout and "mean acceptance length" in r.stdout


def test_import_stays_light():
    # `import specdec_ext` must not import the models, tokenizers or transformers (DESIGN §4).
    code = "import sys, specdec_ext; print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', " \
           "'tokenizers', 'gguf', 'safetensors') or m.startswith('specdec_ext.models')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_generate_drafts_with_the_shipped_eagle_head_by_default():
    r = run_cli("generate", "--device", "cpu", "--chat", "--max-new-tokens", "24", "--prompt",
                "What is the capital of France? Answer in one sentence.")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "paris" in r.stdout.lower(), r.stdout
    assert "[eagle drafter" in r.stderr and "mean acceptance length" in r.stderr, r.stderr


def test_generate_with_tree_rounds():
    r = run_cli("generate", "--device", "cpu", "--chat", "--max-new-tokens", "24", "--tree", "nodes=8,depth=4",
                "--prompt", "What is the capital of France? Answer in one sentence.")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "paris" in r.stdout.lower(), r.stdout
    assert "[eagle drafter, trees of <= 8 nodes, depth 4, branching 4" in r.stderr, r.stderr
    r = run_cli("generate", "--device", "cpu", "--tree", "nodes=8,depth=9", "--prompt", "Hi")
    assert r.returncode == 2 and "depth 9 needs at least 10 num_nodes" in r.stderr, r.stderr

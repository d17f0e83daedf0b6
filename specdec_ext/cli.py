"""The `specdec` command: demo, bench, info."""
import argparse
import importlib
import platform
import sys
from pathlib import Path

import torch

BENCHMARKS = ("attention", "e2e", "philox", "sampling")


def cmd_info(args) -> int:
    import specdec_ext

    info = specdec_ext.build_info()
    print(f"specdec_ext {specdec_ext.__version__} ({Path(specdec_ext.__file__).parent})")
    print(f"python {platform.python_version()}, torch {torch.__version__}, torch CUDA {torch.version.cuda or 'none'}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs")
    else:
        print("GPU: none visible")
    if info["cuda"]:
        runtime = info["cuda_runtime_compiled"]
        print(f"CUDA kernels: compiled for architectures {info['cuda_archs']} (CUDA runtime {runtime // 1000}.{runtime % 1000 // 10})")
    else:
        print("CUDA kernels: not compiled (CPU-only build)")
    features = ", ".join(info["cpu_features_compiled"]) or "baseline x86-64"
    threads = f"{torch.get_num_threads()} threads" if info["openmp"] else "1 thread (built without OpenMP)"
    print(f"CPU kernels: {info['compiler']}; compiled for {features}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {threads}")
    try:
        from specdec_ext import sim

        sim_info = sim.build_info()
        print(f"emulator: present (AddressSanitizer: {'yes' if sim_info['address_sanitizer'] else 'no'})")
    except ImportError as e:
        print(f"emulator: not available ({str(e).splitlines()[0][:120]})")
    return 0


def cmd_demo(args) -> int:
    from specdec_ext import demo

    return demo.main(device=args.device)


def cmd_bench(args) -> int:
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "common.py").exists():
        print("specdec bench: the benchmarks live in bench/ of a source checkout; run this command there", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    module = importlib.import_module(f"bench.{args.name}")
    return module.main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="the build: versions, CUDA architectures compiled in, CPU features, emulator")
    info.set_defaults(fn=cmd_info)
    demo = sub.add_parser("demo", help="a short end-to-end run of the ops")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.set_defaults(fn=cmd_demo)
    bench = sub.add_parser("bench", help="microbenchmarks: ours against the PyTorch reference")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--repeats", type=int, default=50, help="timed repeats after warm-up (median reported)")
    bench.add_argument("--json", default=None, help="write the results to this JSON file")
    bench.add_argument("--plot", default=None, help="write a bar chart of the ratios to this PNG file")
    bench.add_argument("--batch", default=None, help="comma-separated batch sizes (default: the benchmark's grid)")
    bench.add_argument("--k", default=None, help="comma-separated numbers of draft tokens (attention: queries Q)")
    bench.add_argument("--vocab", default=None, help="comma-separated vocabulary sizes (attention: context lengths)")
    bench.add_argument("--flex", action="store_true", help="attention: also time FlexAttention (compiles per shape)")
    bench.add_argument("--dtype", default=None, help="e2e: comma-separated dtypes (default float32,bfloat16)")
    bench.add_argument("--new-tokens", type=int, default=None, help="e2e: tokens generated per request (default 128)")
    bench.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

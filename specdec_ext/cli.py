"""The `specdec` command: demo, generate, bench, info. Each command's module registers its subcommand."""
import argparse
import platform
import sys
from pathlib import Path

import torch


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="the build: versions, CUDA architectures compiled in, CPU features, emulator")
    info.set_defaults(fn=cmd_info)
    from . import bench, demo, generate, training

    for module in (demo, generate, bench, training):
        module.register(sub)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

"""`specdec info`: the build: versions, the CUDA architectures compiled in, CPU features and the instruction set the
CPU kernels run, the emulator."""
import os
import platform
from pathlib import Path

from .common import UsageError, cpu_isa


def emulator_line() -> str:
    """`specdec info`'s emulator line. An emulator built with AddressSanitizer (scripts/test.sh) cannot be imported
    into a process that did not start with the ASan runtime (the runtime aborts it): it is probed in a child process
    with the runtime preloaded, and the line says how to run it."""
    from .. import _extension

    try:
        from .. import sim

        return f"present (AddressSanitizer: {'yes' if sim.build_info()['address_sanitizer'] else 'no'})"
    except _extension.EmulatorNeedsASanRuntime as e:
        code = "import json; from specdec_ext import sim; print(json.dumps(sim.build_info()))"
        rc, out, err = _extension.run_sim_in_subprocess(code, timeout=120)
        hint = _extension.sim_asan_hint(e.preload, "python ...")
        if rc != 0:
            why = (err.strip().splitlines() or [f"exit {rc}"])[-1][:200]
            return f"built with AddressSanitizer, but importing it with the ASan runtime preloaded failed ({why})"
        return (f"present (AddressSanitizer: yes; probed in a child process with the ASan runtime preloaded, as "
                f"importing it here would abort: use it with {hint}, or rebuild it without ASan: "
                f"SPECDEC_SIM_ASAN=0 bash scripts/setup_env.sh)")
    except ImportError as e:
        return f"not available ({str(e).splitlines()[0][:120]})"


def main(args) -> int:
    import torch

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
        print(f"CUDA kernels: compiled for architectures {info['cuda_archs']} (CUDA runtime {runtime // 1000}."
              f"{runtime % 1000 // 10})")
    else:
        print("CUDA kernels: not compiled (CPU-only build)")
    features = ", ".join(info["cpu_features_compiled"]) or "baseline x86-64"
    threads = f"{torch.get_num_threads()} threads" if info["openmp"] else "1 thread (built without OpenMP)"
    print(f"CPU kernels: {info['compiler']}; compiled for {features}; torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {threads}")
    isa, problem = cpu_isa()
    forced = "SPECDEC_CPU_ISA" if os.environ.get("SPECDEC_CPU_ISA") else "the best this CPU has"
    print(f"CPU kernel instruction set: {isa} ({forced})" if isa else f"CPU kernel instruction set: none: {problem}")
    print(f"emulator: {emulator_line()}")
    if problem:  # the rest of the report is still worth having; the exit status says the setting is bad
        raise UsageError(problem)
    return 0


def register(sub) -> None:
    info = sub.add_parser("info", help="the build: versions, CUDA architectures compiled in, CPU features, emulator")
    info.set_defaults(fn=main)

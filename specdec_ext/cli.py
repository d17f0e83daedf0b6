"""The `specdec` command: demo, generate, bench, info. Each command's module registers its subcommand.

cli.main checks every argument and SPECDEC_CPU_ISA before anything is loaded (a usage error: one line, exit 2), and
ends a run without a traceback: a library error is one line (exit 1), Ctrl-C exits 130, a closed stdout (`| head`)
exits quietly (141, as a process killed by SIGPIPE).
"""
import argparse
import math
import os
import platform
import sys
from pathlib import Path

import torch


class UsageError(Exception):
    """A bad input found once the command runs (e.g. a prompt longer than the model's context): exit 2."""


def emulator_line() -> str:
    """`specdec info`'s emulator line. An emulator built with AddressSanitizer (scripts/test.sh) cannot be imported
    into a process that did not start with the ASan runtime (the runtime aborts it): it is probed in a child process
    with the runtime preloaded, and the line says how to run it."""
    from specdec_ext import _extension

    try:
        from specdec_ext import sim

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


def cpu_isa() -> tuple[str | None, str | None]:
    """(the instruction set the CPU kernels use, None), or (None, why not): SPECDEC_CPU_ISA names one that is no
    instruction set or one this CPU lacks. ops.cpu_isa() decides; its message is cut to its first line (an extension
    build may append a C++ backtrace)."""
    from specdec_ext import ops

    try:
        return ops.cpu_isa(), None
    except ValueError as e:
        return None, (str(e).strip().splitlines() or ["SPECDEC_CPU_ISA is invalid"])[0]


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
    isa, problem = cpu_isa()
    forced = "SPECDEC_CPU_ISA" if os.environ.get("SPECDEC_CPU_ISA") else "the best this CPU has"
    print(f"CPU kernel instruction set: {isa} ({forced})" if isa else f"CPU kernel instruction set: none: {problem}")
    print(f"emulator: {emulator_line()}")
    if problem:  # the rest of the report is still worth having; the exit status says the setting is bad
        raise UsageError(problem)
    return 0


def tree_settings(spec: str):
    """--tree's value as TreeSettings (argparse reports a bad one as a usage error)."""
    import argparse

    from .trees import TreeSettings

    try:
        return TreeSettings.of(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    try:
        try:
            rc = _run(argv)
            sys.stdout.flush()
            return rc
        except KeyboardInterrupt:
            print("\nspecdec: interrupted", file=sys.stderr)
            return 130
    except BrokenPipeError:
        # The reader closed stdout (`specdec generate ... | head`): stop quietly. Python flushes stdout again at exit;
        # pointing it at /dev/null keeps that flush from raising (as Python's documentation of SIGPIPE advises).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(argv) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="the build: versions, CUDA architectures compiled in, CPU features, emulator")
    info.set_defaults(fn=cmd_info)
    from . import bench, demo, generate, training

    for module in (demo, generate, bench, training):
        module.register(sub)
    args = parser.parse_args(argv)
    command = sub.choices[args.command]
    validate(command, args)
    try:
        return args.fn(args)
    except UsageError as e:
        command.error(one_line(e))  # exits 2
    except BrokenPipeError:
        raise
    except (ValueError, RuntimeError, OSError) as e:
        print(f"specdec: error: {one_line(e)}", file=sys.stderr)
        return 1


def one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    lines = text.splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "")


# Ranges of the numeric arguments, by their dest, wherever a subcommand has them (int or float values only: bench's
# --k is a comma-separated list, checked by the benchmark).
def _k_range():
    from specdec_ext.ops import LIMITS

    return 1, LIMITS["max_draft_tokens"]


_RANGES = {
    "max_new_tokens": (lambda v: v >= 1, "must be >= 1"),
    "new_tokens": (lambda v: v >= 1, "must be >= 1"),
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0 (0: greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0: off)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1: off)"),
    "seed": (lambda v: -(2**63) <= v < 2**63, "must fit in a signed 64-bit integer"),
    "k": (lambda v: _k_range()[0] <= v <= _k_range()[1], "must be in [{lo}, {hi}]"),
    "max_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "repeats": (lambda v: v >= 1, "must be >= 1"),
    "epochs": (lambda v: v >= 1, "must be >= 1"),
    "lr": (lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0"),
    "tokens_per_batch": (lambda v: v >= 1, "must be >= 1"),
    "unroll": (lambda v: v >= 1, "must be >= 1"),
    "vocab_size": (lambda v: v >= 1, "must be >= 1"),
    "sampled_answers": (lambda v: v >= 0, "must be >= 0"),
    "limit": (lambda v: v >= 0, "must be >= 0 (0: all)"),
    "eval_prompts": (lambda v: v >= 0, "must be >= 0"),
}
_EXISTING_PATHS = ("model", "draft")  # dests naming a file or folder to read
_PATHS = _EXISTING_PATHS + ("out", "json", "plot")  # may hold any bytes; every other string must be valid UTF-8


def _flag(command: argparse.ArgumentParser, dest: str) -> str:
    for action in command._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return dest


def _check_device(spec: str) -> str | None:
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        return f"{spec!r} is not a device: give cpu or cuda (or cuda:N)"
    if device.type not in ("cpu", "cuda"):
        return f"{spec!r}: specdec runs on cpu or cuda"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"{spec}: no CUDA device is visible here (torch.cuda.is_available() is False); use --device cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"{spec}: there are {torch.cuda.device_count()} CUDA devices"
    return None


def validate(command: argparse.ArgumentParser, args) -> None:
    """Every argument's value, before the command loads anything: command.error (one line, exit 2) on the first bad
    one. The subcommand's own checks: its set_defaults(validate=fn), fn(args) raising ValueError."""
    for dest, value in vars(args).items():
        if dest in ("fn", "validate", "command") or value is None:
            continue
        flag = _flag(command, dest)
        if isinstance(value, str) and dest not in _PATHS:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = value[e.start].encode("utf-8", "surrogateescape")
                command.error(f"{flag} is not valid UTF-8 text (byte 0x{bad.hex()} at character {e.start}); "
                              f"pass UTF-8 text")
        if dest in _RANGES and isinstance(value, (int, float)) and not isinstance(value, bool):
            ok, message = _RANGES[dest]
            if not ok(value):
                lo, hi = _k_range()
                command.error(f"{flag} {message.format(lo=lo, hi=hi)}, got {value}")
        if dest in _EXISTING_PATHS and isinstance(value, str) and not os.path.exists(value):
            command.error(f"{flag} {value}: no such file or directory")
        if dest == "device" and isinstance(value, str):
            problem = _check_device(value)
            if problem:
                command.error(f"{flag} {problem}")
    check = getattr(args, "validate", None)
    if check is not None:
        try:
            check(args)
        except ValueError as e:
            command.error(one_line(e))
    # The CPU kernels read SPECDEC_CPU_ISA at their first call, after the model is loaded: a bad value is found
    # here instead. `specdec info` reports it among the rest of the build (cmd_info).
    if args.command != "info":
        problem = cpu_isa()[1]
        if problem:
            command.error(problem)


if __name__ == "__main__":
    sys.exit(main())

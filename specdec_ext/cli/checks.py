"""Every argument's value, checked before a command loads anything: the numeric ranges, paths, UTF-8 text and the
device wherever a subcommand has them, then the subcommand's own checks, then SPECDEC_CPU_ISA."""
import argparse
import math
import os

from .common import cpu_isa, one_line


# Ranges of the numeric arguments, by their dest, wherever a subcommand has them (int or float values only: bench's
# --k is a comma-separated list, checked by the benchmark).
def _k_range():
    from ..ops import LIMITS

    return 1, LIMITS["max_draft_tokens"]


_RANGES = {
    "max_new_tokens": (lambda v: v >= 1, "must be >= 1"),
    "new_tokens": (lambda v: v >= 1, "must be >= 1"),
    "temperature": (lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0 (0: greedy)"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0: off)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1: off)"),
    "seed": (lambda v: -(2**63) <= v < 2**63, "must fit in a signed 64-bit integer"),
    "repetition_penalty": (lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0 (1: off)"),
    "presence_penalty": (lambda v: math.isfinite(v), "must be a finite number (0: off)"),
    "frequency_penalty": (lambda v: math.isfinite(v), "must be a finite number (0: off)"),
    "min_p": (lambda v: 0 <= v < 1, "must be in [0, 1) (0: off)"),
    "min_tokens": (lambda v: v >= 0, "must be >= 0"),
    "logprobs": (lambda v: 0 <= v <= 20, "must be in [0, 20]"),
    "k": (lambda v: _k_range()[0] <= v <= _k_range()[1], "must be in [{lo}, {hi}]"),
    "max_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "repeats": (lambda v: v >= 1, "must be >= 1"),
    "epochs": (lambda v: v >= 1, "must be >= 1"),
    "lr": (lambda v: math.isfinite(v) and v > 0, "must be a finite number > 0"),
    "tokens_per_batch": (lambda v: v >= 1, "must be >= 1"),
    "unroll": (lambda v: v >= 1, "must be >= 1"),
    "vocab_size": (lambda v: v >= 0, "must be >= 0 (0: by coverage)"),
    "sampled_answers": (lambda v: v >= 0, "must be >= 0"),
    "limit": (lambda v: v >= 0, "must be >= 0 (0: all)"),
    "eval_prompts": (lambda v: v >= 0, "must be >= 0"),
    "template_prompts": (lambda v: v >= 0, "must be >= 0"),
    "target_questions": (lambda v: v >= 0, "must be >= 0"),
    "text_tokens": (lambda v: v >= 0, "must be >= 0"),
}
_EXISTING_PATHS = ("model", "data")  # dests naming a file or folder to read (`bench e2e --draft`: its own check)
_PATHS = _EXISTING_PATHS + ("draft", "out", "json", "plot")  # may hold any bytes; other strings must be UTF-8


def _parsers(command: argparse.ArgumentParser, args) -> list:
    """The command's parser and the nested ones that args chose (`bench NAME` has a parser per benchmark)."""
    chosen = [command]
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            chosen += _parsers(action.choices[getattr(args, action.dest)], args)
    return chosen


def _flag(parsers: list, dest: str) -> str:
    for parser in parsers:
        for action in parser._actions:
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
    parsers = _parsers(command, args)
    for dest, value in vars(args).items():
        if dest in ("fn", "validate", "command") or value is None:
            continue
        flag = _flag(parsers, dest)
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
    # here instead. `specdec info` reports it among the rest of the build (cli/info.py).
    if args.command != "info":
        problem = cpu_isa()[1]
        if problem:
            command.error(problem)

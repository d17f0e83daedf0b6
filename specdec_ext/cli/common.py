"""What the commands of `specdec` share: the usage error a command raises once it runs, argument types, and the
one-line form of an error. Imports nothing of the library until called (the dispatcher imports it first)."""
import argparse


class UsageError(Exception):
    """A bad input found once the command runs (e.g. a prompt longer than the model's context): exit 2."""


def tree_settings(spec: str):
    """--tree's value as TreeSettings (argparse reports a bad one as a usage error)."""
    from ..trees import TreeSettings

    try:
        return TreeSettings.of(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    lines = text.splitlines()
    return lines[0] + (" ..." if len(lines) > 1 else "")


def cpu_isa() -> tuple[str | None, str | None]:
    """(the instruction set the CPU kernels use, None), or (None, why not): SPECDEC_CPU_ISA names one that is no
    instruction set or one this CPU lacks. ops.cpu_isa() decides; its message is cut to its first line (an extension
    build may append a C++ backtrace)."""
    from .. import ops

    try:
        return ops.cpu_isa(), None
    except ValueError as e:
        return None, (str(e).strip().splitlines() or ["SPECDEC_CPU_ISA is invalid"])[0]

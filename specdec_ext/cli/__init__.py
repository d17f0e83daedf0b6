"""The `specdec` command: demo, generate, bench, info. Each command's module registers its subcommand.

cli.main checks every argument and SPECDEC_CPU_ISA before anything is loaded (a usage error: one line, exit 2), and
ends a run without a traceback: a library error is one line (exit 1), Ctrl-C exits 130, a closed stdout (`| head`)
exits quietly (141, as a process killed by SIGPIPE).

The dispatcher is this file; common.py holds what the commands share, checks.py the checks of every argument, and
each command is a module of its own that registers it (register(sub)) and never imports this file.
"""
import argparse
import os
import sys

from .checks import validate
from .common import UsageError, one_line


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


def parser() -> tuple:
    """(the `specdec` parser, its subcommands' parsers by name)."""
    from . import bench, demo, draft_data, generate, info, train_draft

    specdec = argparse.ArgumentParser(prog="specdec", description=__doc__.split("\n\n")[0])
    sub = specdec.add_subparsers(dest="command", required=True)
    for module in (info, demo, generate, bench, draft_data, train_draft):
        module.register(sub)
    return specdec, sub.choices


def _run(argv) -> int:
    specdec, commands = parser()
    args = specdec.parse_args(argv)
    command = commands[args.command]
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

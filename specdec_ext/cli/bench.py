"""`specdec bench NAME`: one sub-parser per benchmark of specdec_ext.bench, with that benchmark's own flags, under its
name and its former names (specdec_ext.bench.BENCHMARKS)."""
import argparse


def register(sub) -> None:
    """Adds the `bench` command to the subcommands `sub`. The benchmark modules are imported here, when the parser is
    built, not when the CLI is imported."""
    from .. import bench as benchmarks

    bench = sub.add_parser("bench", help="benchmarks: kernels against the PyTorch reference, decoding end to end",
                           description="Benchmarks: each kernel op against its PyTorch reference, the engine shims "
                                       "against the engines' own paths, and decoding end to end. `specdec bench NAME "
                                       "-h` lists a benchmark's flags.")
    names = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, aliases in benchmarks.BENCHMARKS.items():
        module = benchmarks.module(name)
        parser = names.add_parser(name, aliases=list(aliases), help=module.__doc__.split("\n", 1)[0],
                                  description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
    # benchmarks.run looked up when the command runs, so that a test can replace it first.
    bench.set_defaults(fn=lambda args: benchmarks.run(args))

"""The benchmarks of `specdec bench NAME`: the kernel ops against their PyTorch reference, the engine shims against
the engines' own paths, and decoding end to end; shipped with the package so that an installed wheel runs them.

One module per benchmark, named after the op it measures: its docstring's first line is its help, add_arguments(parser)
adds its flags (common.add_common_arguments the ones every benchmark has) and main(args) runs it.
specdec_ext/cli/bench.py builds the command from BENCHMARKS.
"""
import importlib

# Benchmark module -> the other names the command accepts for it: the names the benchmarks had before they were named
# after their op, which documents, scripts and older result notes use.
BENCHMARKS = {
    "chain_sampling": ("sampling",),
    "chain_sampling_flat": ("flat_sampling",),
    "chain_sampling_row_filters": ("row_filters",),
    "compat_flashinfer": (),
    "compat_sglang": (),
    "compat_transformers": (),
    "compat_vllm": (),
    "compat_vllm_v2": (),
    "cpu_forward": (),
    "draft_heads": (),
    "e2e": (),
    "generation_controls": (),
    "online_training": (),
    "philox_uniform": ("philox",),
    "quantized_linear": (),
    "tree_sampling": (),
    "verify_attention": ("attention",),
}
ALIASES = {alias: name for name, aliases in BENCHMARKS.items() for alias in aliases}


def module(name: str):
    """The module of benchmark `name`, given by its name or one of its aliases."""
    name = ALIASES.get(name, name)
    if name not in BENCHMARKS:
        raise ValueError(f"no benchmark {name!r}: the benchmarks are {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"{__name__}.{name}")


def run(args) -> int:
    """Runs benchmark args.benchmark (its name or an alias, as `specdec bench` parsed it) with its parsed flags."""
    return module(args.benchmark).main(args)

"""`specdec bench NAME`: the kernel microbenchmarks (ours against the PyTorch reference) and the end-to-end
decoding benchmark, shipped with the package so that an installed wheel runs them."""
import importlib

BENCHMARKS = ("attention", "compat_flashinfer", "compat_sglang", "compat_transformers", "compat_vllm", "cpu_forward",
              "e2e", "flat_sampling", "philox", "quantized_linear", "row_filters", "sampling", "tree_sampling")


def run(args) -> int:
    return importlib.import_module(f"{__name__}.{args.name}").main(args)


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: kernels against the PyTorch reference, decoding end to end")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--repeats", type=int, default=50, help="timed repeats after warm-up (median reported)")
    bench.add_argument("--json", default=None, help="write the results to this JSON file")
    bench.add_argument("--plot", default=None, help="write a bar chart of the ratios to this PNG file")
    bench.add_argument("--batch", default=None, help="comma-separated batch sizes (default: the benchmark's grid; "
                                                     "quantized_linear: rows M)")
    bench.add_argument("--k", default=None, help="comma-separated numbers of draft tokens (attention: queries Q; "
                                                 "e2e: fixed k and 'adaptive'; tree_sampling: tree nodes N)")
    bench.add_argument("--vocab", default=None, help="comma-separated vocabulary sizes (attention: context lengths)")
    bench.add_argument("--flex", action="store_true", help="attention: also time FlexAttention (compiles per shape)")
    bench.add_argument("--layouts", action="store_true", help="attention: engine layouts (HND, CSR pages, flat q) "
                                                               "against the padded NHD call, B = 8, context 2048")
    bench.add_argument("--dtype", default=None, help="e2e: comma-separated dtypes (default float32,bfloat16)")
    bench.add_argument("--new-tokens", type=int, default=None,
                       help="e2e, cpu_forward: tokens generated per request (default 128)")
    bench.add_argument("--prompts", default=None, help="e2e: comma-separated prompt names (chat,code,summarise, and "
                       "heldout: held-out chat prompts of the shipped prompt set, never trained on)")
    bench.add_argument("--drafters", default=None, help="e2e: comma-separated drafters (default ngram,eagle,medusa: "
                       "prompt lookup and the shipped model's trained heads; also lookahead[:W/N/G])")
    bench.add_argument("--sampling", default=None,
                       help="e2e: greedy,sampled,invariant (sampled: temperature 0.7, top-p 0.9, rejection sampling; "
                            "invariant: the same with Gumbel coupling)")
    bench.add_argument("--draft", default=None, help="e2e: a draft model (HF dir or .gguf) for ModelDrafter rows")
    bench.add_argument("--tree", action="append", default=None, help="e2e: tree rows of these settings, N or "
                       "nodes=N,depth=D,branching=K (repeatable; default: the default TreeSettings)")
    bench.add_argument("--plain-only", action="store_true", help="e2e: only plain decoding against transformers")
    bench.add_argument("--speculative-only", action="store_true", help="e2e: only the speculative table")
    bench.set_defaults(fn=run)

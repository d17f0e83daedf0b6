"""What the commands, the demo, the benchmarks and training build models and drafters with: the device, a model
and its tokenizer from a path, a drafter from its command-line spelling, and a prompt's token ids (the chat
template applied here only)."""
import sys
from pathlib import Path

import torch


def choose_device(name: str | None = None) -> torch.device:
    """`name` (cpu, cuda, cuda:1), or CUDA when a GPU is visible, else the CPU."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def load(path, device, dtype: torch.dtype = torch.float32, keep_quantized: bool = False, activations=None):
    """A model and its tokenizer from an HF directory or a .gguf file, with a progress bar; keep_quantized: the
    GGUF block weights stay as stored, activations: how they multiply (LlamaForCausalLM.from_pretrained)."""
    from tqdm import tqdm

    from .models import LlamaForCausalLM, load_tokenizer

    with tqdm(total=2, desc=f"loading {path}", unit="part", file=sys.stderr, leave=False) as bar:
        model = LlamaForCausalLM.from_pretrained(path, device=device, dtype=dtype, keep_quantized=keep_quantized,
                                                 activations=activations)
        bar.update()
        tokenizer = load_tokenizer(path)
        bar.update()
    return model, tokenizer


def prompt_ids(tokenizer, text: str, chat: bool = True) -> list:
    """The token ids of `text`: with chat, a user turn of the model's chat template and the assistant's opening."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=False)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]


def check_drafter(spec: str, model_path=None):
    """The DrafterEntry (drafters/registry.py) of a drafter spec that make_drafter accepts; ValueError when it is not
    (its syntax, the PATH it names, and whether heads ship for model_path: None is the default model), before anything
    is loaded."""
    from .drafters.registry import parse_drafter

    return parse_drafter(spec, lambda: model_path is None or _is_the_default_model(model_path))[0]


def make_drafter(spec: str, target, model_path=None, keep_quantized: bool = False):
    """The drafter a spec names, built for `target` by its registry entry (drafters/registry.py): 'ngram',
    'lookahead[:W/N/G]' (LookaheadDrafter(window=W, ngram=N, guesses=G); without them its defaults), 'model:PATH'
    (a draft model; keep_quantized: its GGUF block weights kept as stored, whatever the target's), 'eagle[:PATH]' or
    'medusa[:PATH]' (trained heads for the target; without a PATH, the heads shipped for the default model, when
    model_path is that model: None, an unknown model, is refused), or any drafter registered besides."""
    from .drafters.registry import parse_drafter

    entry, arguments = parse_drafter(spec, lambda: model_path is not None and _is_the_default_model(model_path))
    if entry.needs_draft_model:
        arguments["keep_quantized"] = keep_quantized
    return entry.build(target, **arguments)


def _is_the_default_model(model_path) -> bool:
    from .models import default_model_path

    return Path(model_path).resolve() == default_model_path().resolve()

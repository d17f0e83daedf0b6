"""What the commands, the demo, the benchmarks and training build models and drafters with: the device, a model
and its tokenizer from a path, a drafter from its command-line spelling, and a prompt's token ids (the chat
template applied here only)."""
import sys
from pathlib import Path

import torch

DRAFTER_SYNTAX = "ngram, lookahead[:W/N/G], model:PATH, eagle[:PATH] or medusa[:PATH]"


def choose_device(name: str | None = None) -> torch.device:
    """`name` (cpu, cuda, cuda:1), or CUDA when a GPU is visible, else the CPU."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def load(path, device, dtype: torch.dtype = torch.float32, keep_quantized: bool = False):
    """A model and its tokenizer from an HF directory or a .gguf file, with a progress bar; keep_quantized: the
    GGUF block weights stay as stored (LlamaForCausalLM.from_pretrained)."""
    from tqdm import tqdm

    from .models import LlamaForCausalLM, load_tokenizer

    with tqdm(total=2, desc=f"loading {path}", unit="part", file=sys.stderr, leave=False) as bar:
        model = LlamaForCausalLM.from_pretrained(path, device=device, dtype=dtype, keep_quantized=keep_quantized)
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


def heads_only_for_the_default_model(kind: str) -> ValueError:
    return ValueError(f"--drafter {kind}: heads ship for the default model only; give {kind}:PATH, made by "
                      f"`specdec train-draft --kind {kind}`")


def check_drafter(spec: str, model_path=None) -> None:
    """Raises ValueError when a drafter spec is not one make_drafter accepts (its syntax, the PATH it names, and
    whether heads ship for model_path: None is the default model), before anything is loaded."""
    from .models import default_model_path

    kind, colon, path = spec.partition(":")
    if spec == "ngram":
        return
    if kind == "lookahead":
        lookahead_settings(spec)
        return
    if kind not in ("model", "eagle", "medusa") or (kind == "model" and not path) or (colon and not path):
        raise ValueError(f"--drafter must be {DRAFTER_SYNTAX}, got {spec!r}")
    if path and not Path(path).exists():
        raise ValueError(f"--drafter {spec}: no such file or directory")
    if kind != "model" and not path and model_path is not None and \
            Path(model_path).resolve() != default_model_path().resolve():
        raise heads_only_for_the_default_model(kind)


def lookahead_settings(spec: str) -> dict:
    """'lookahead' or 'lookahead:W/N/G' -> LookaheadDrafter's arguments (checked by building one)."""
    from .drafters import LookaheadDrafter

    _, colon, values = spec.partition(":")
    if not colon:
        return {}
    parts = values.split("/")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--drafter lookahead:W/N/G takes three ints (window, ngram, guesses), got {spec!r}")
    settings = dict(zip(("window", "ngram", "guesses"), (int(p) for p in parts)))
    try:
        LookaheadDrafter(**settings)
    except ValueError as e:
        raise ValueError(f"--drafter {spec}: {e}") from None
    return settings


def make_drafter(spec: str, target, model_path=None, keep_quantized: bool = False):
    """'ngram', 'lookahead[:W/N/G]' (LookaheadDrafter(window=W, ngram=N, guesses=G); without them its defaults),
    'model:PATH' (a draft model; keep_quantized: its GGUF block weights kept as stored, whatever the
    target's), 'eagle[:PATH]' or 'medusa[:PATH]' (trained heads for the target; without a PATH, the heads shipped
    for the default model, when model_path is that model)."""
    from .drafters import EagleDrafter, LookaheadDrafter, MedusaDrafter, ModelDrafter, NgramDrafter
    from .models import LlamaForCausalLM, default_head_path
    from .models.draft_heads import EagleHead, MedusaHeads

    kind, _, path = spec.partition(":")
    if kind in ("eagle", "medusa") and not path and model_path is None:  # no model path: which model is unknown
        raise heads_only_for_the_default_model(kind)
    check_drafter(spec, model_path)
    if spec == "ngram":
        return NgramDrafter()
    if kind == "lookahead":
        return LookaheadDrafter(**lookahead_settings(spec))
    if kind == "model":
        return ModelDrafter(LlamaForCausalLM.from_pretrained(path, device=target.device, dtype=target.dtype,
                                                             keep_quantized=keep_quantized))
    path = path or default_head_path(kind)
    if kind == "eagle":
        return EagleDrafter(target, EagleHead.load(path, target))
    return MedusaDrafter(target, MedusaHeads.load(path, target))

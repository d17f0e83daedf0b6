"""The tokenizer of a model path: a Hugging Face directory or a .gguf file (whose tokenizer transformers
rebuilds from the GGUF metadata), with its chat template."""
from pathlib import Path


def load_tokenizer(path):
    """A transformers tokenizer for a Hugging Face model directory or a .gguf file."""
    from transformers import AutoTokenizer  # imported here: transformers is needed only for tokenizers

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.is_dir() and ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return AutoTokenizer.from_pretrained(str(path))
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return AutoTokenizer.from_pretrained(str(path), gguf_file=ggufs[0].name)
    raise ValueError(f"load_tokenizer: {str(path)!r} is neither a model directory with a tokenizer nor a .gguf file")

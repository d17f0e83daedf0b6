"""Llama-family models on this library's ops, and their loaders (Hugging Face directory, transformers object,
GGUF). Imported on demand: `import specdec_ext` does not import this package or transformers."""
from .config import LlamaConfig
from .default import default_head_path, default_model_path
from .llama import LlamaForCausalLM
from .tokenizer import load_tokenizer

__all__ = ["LlamaConfig", "LlamaForCausalLM", "default_head_path", "default_model_path", "load_tokenizer"]

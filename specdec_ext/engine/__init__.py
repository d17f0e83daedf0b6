"""The decoder that runs a target and a drafter on this library's ops: the loop (decoder.py), one round
(rounds.py), how much to draft (policy.py), the requests (requests.py) and what a call reports (stats.py)."""
from .decoder import SpeculativeDecoder, generate_autoregressive
from .policy import CostModel
from .stats import AcceptanceMonitor, GenerationOutput, GenerationStats

__all__ = ["AcceptanceMonitor", "CostModel", "GenerationOutput", "GenerationStats", "SpeculativeDecoder",
           "generate_autoregressive"]

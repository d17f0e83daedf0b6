"""Drafters: what proposes the tokens a round verifies. The protocol is in base.py; one file per drafter."""
from .base import Drafter, Proposal, RoundFeedback, RoundInputs
from .eagle import EagleDrafter
from .lookahead import LookaheadDrafter, LookaheadStats
from .medusa import MedusaDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter
from .oracle import OracleDrafter
from .self_speculative import SelfSpeculativeDrafter

__all__ = ["Drafter", "EagleDrafter", "LookaheadDrafter", "LookaheadStats", "MedusaDrafter", "ModelDrafter",
           "NgramDrafter", "OracleDrafter", "Proposal", "RoundFeedback", "RoundInputs", "SelfSpeculativeDrafter"]

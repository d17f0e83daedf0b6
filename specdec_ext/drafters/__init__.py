"""Drafters: what proposes the tokens a round verifies. The protocol is in base.py; one file per drafter."""
from .base import Drafter, Proposal, RoundInputs
from .eagle import EagleDrafter
from .medusa import MedusaDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "EagleDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "RoundInputs"]

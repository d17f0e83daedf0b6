"""Stand-in `flashinfer.sampling`: chain_speculative_sampling is specdec_ext's shim; nothing else is provided."""
from specdec_ext.compat.flashinfer.sampling import chain_speculative_sampling

__all__ = ["chain_speculative_sampling"]


def __getattr__(name):
    raise AttributeError(f"flashinfer.sampling.{name} is not part of specdec_ext's stand-in")

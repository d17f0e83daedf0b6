"""transformers shim (contract of transformers 5.17 to 5.25): `generate(..., assistant_model=..., do_sample=True)`
verifies the assistant's candidates with specdec_ext's from-logits chain sampling kernel instead of transformers' own
`_speculative_sampling`.

    from specdec_ext.compat import transformers as specdec_transformers

    with specdec_transformers.patch():
        out = model.generate(input_ids, assistant_model=draft, do_sample=True, top_k=50, top_p=0.9)

What is patched: `_assisted_decoding` looks up the module global `transformers.generation.utils._speculative_sampling`
at every call, so `patch()` rebinds that name to `speculative_sampling` below and `unpatch()` puts the original back.

Lossless under temperature, top-k, top-p and the other logits processors: transformers hands the function the
target's processed rows (its logits processors applied per position, after the forward) and the assistant's
processed scores (the assistant generates with a copy of the target's generation config and the same processors),
so p and q are exactly the laws the tokens are sampled from; the kernel takes them at temperature 1 and its
residual is max(0, p - q) of that processed pair. -inf entries (top-k / top-p filtered tokens) have probability 0;
a token the assistant gives 0 but the target allows keeps its full p in the residual.
`assistant_ensemble_weight` (DIVERSE ensemble verification, lossy by design) is refused.

Randomness: the kernel's Philox key is drawn from torch's default generator on the logits' device, so
`torch.manual_seed(s)` before `generate()` reproduces the call (transformers' own sampling uses the same generator).
transformers reads the accepted count on the host anyway (it slices by it); the shim adds no other host read.

transformers is imported only when `patch()` is called: importing this module does not import it.
"""
import contextlib
import threading

import torch

from . import backend

_lock = threading.Lock()
_original = None  # transformers' own function while ours is installed


def speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, is_done_candidate=None,
                         assistant_ensemble_weight=None):
    """transformers' `_speculative_sampling` (5.17 to 5.25) on specdec_ext's kernel: same arguments, same return
    convention.

    candidate_input_ids [1, S + K] (the prompt so far, then the assistant's K = candidate_length candidates),
    candidate_logits [1, K, V] (the assistant's processed scores), new_logits [1, K + 1, V] float32 (the target's
    processed logits at the K candidate positions and the one after them).
    Returns (valid_tokens [1, n + 1] int64: the n accepted candidates, then the resampled or bonus token;
    n_matches: a 0-d int64 tensor, n). Batch size 1 only, as transformers' assisted decoding.

    transformers 4.x to 5.17 called it with a fifth positional `is_done_candidate` (a bool, or 5.17's [1] bool tensor
    from its stopping criteria), and 5.17 with
    `assistant_ensemble_weight=` besides: when all candidates are accepted and the last one ended the sequence, no
    bonus token follows (valid_tokens are the K candidates, n_matches = K - 1). 5.18 on drop that argument (the
    caller crops at EOS / max_length) and pass the weight by keyword; a fifth positional that is not a bool is read
    as their assistant_ensemble_weight.
    """
    flag = isinstance(is_done_candidate, bool) or (isinstance(is_done_candidate, torch.Tensor) and
                                                   is_done_candidate.dtype == torch.bool)
    if is_done_candidate is not None and not flag:
        if assistant_ensemble_weight is not None:
            raise TypeError("speculative_sampling: assistant_ensemble_weight given twice")
        is_done_candidate, assistant_ensemble_weight = None, is_done_candidate
    is_done_candidate = bool(is_done_candidate) if is_done_candidate is not None else False  # 5.17: a [1] bool tensor
    if assistant_ensemble_weight is not None:
        raise ValueError("specdec_ext.compat.transformers: assistant_ensemble_weight="
                         f"{assistant_ensemble_weight} relaxes verification (lossy); this library is lossless: "
                         "leave it None, or unpatch() to use transformers' own verification")
    if candidate_input_ids.shape[0] != 1:
        raise ValueError(f"speculative_sampling: batch size 1 only (as transformers' assisted decoding), "
                         f"got {candidate_input_ids.shape[0]}")
    drafts = candidate_input_ids[:, -candidate_length:]
    draft_logits = candidate_logits.to(new_logits.dtype)  # the assistant may score in another dtype
    out = backend().chain_speculative_sampling_from_logits(drafts, new_logits, draft_logits, temperature=1.0)
    n = int(out.num_accepted[0])  # transformers slices by it: its one host read per round
    if is_done_candidate and n == candidate_length:
        return drafts[:, :n], torch.tensor(n - 1, device=drafts.device)
    return out.output_token_ids[:, :n + 1].long(), out.num_accepted[0].long()


def _utils():
    import transformers.generation.utils as utils

    return utils


class _Patched(contextlib.AbstractContextManager):
    """patch()'s result: on exit, the state found on entry comes back (an enclosing patch() stays in force)."""

    def __init__(self, was_patched: bool):
        self._was_patched = was_patched

    def __exit__(self, *exc):
        if not self._was_patched:
            unpatch()
        return False


def patch() -> _Patched:
    """Installs `speculative_sampling` as transformers' `_speculative_sampling`; a plain call or a context manager.

    Idempotent: patching again changes nothing, and a nested `with patch():` leaves the outer patch in force.
    The patch is process-wide (a module global): generate() calls on every thread use it, each with the ops of
    its own thread's `specdec_ext.compat.backend()`. patch() and unpatch() are serialised by a lock; a generate()
    running while another thread unpatches picks up whichever function is installed at its next round.
    """
    global _original
    utils = _utils()
    with _lock:
        was_patched = utils._speculative_sampling is speculative_sampling
        if not was_patched:
            _original, utils._speculative_sampling = utils._speculative_sampling, speculative_sampling
    return _Patched(was_patched)


def unpatch() -> None:
    """Restores transformers' own `_speculative_sampling`; a no-op when not patched."""
    global _original
    with _lock:
        if _original is None:
            return
        utils = _utils()
        if utils._speculative_sampling is speculative_sampling:  # someone else's patch on top of ours stays
            utils._speculative_sampling = _original
        _original = None


def is_patched() -> bool:
    """Whether transformers' assisted sampling currently runs on this library's kernel."""
    import sys

    utils = sys.modules.get("transformers.generation.utils")
    return utils is not None and utils._speculative_sampling is speculative_sampling

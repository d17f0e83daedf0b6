"""The public ops: argument checks and defaults, then one call into torch.ops.specdec; fake kernels so the
ops trace under torch.compile and CUDA-graph capture.

Each op is defined once, as a method of `Ops`, bound to an op namespace: NATIVE (torch.ops.specdec, whose
methods are this module's functions) and specdec_ext.sim's (torch.ops.specdec_sim), so that the emulated
kernels get exactly the same checks. An op is found by its name: `Ops.<op>` is the documented wrapper; a module
function checks the arguments and calls the schema (`_<op>`; `_chain_sampling` and `_tree_sampling` serve both forms of
a sampling op, `_sample_without_drafts` sample_without_drafts and gumbel_sample); `_<op>_fake`, right after it, is the
schema's fake kernel. The ops without an emulated twin (skinny_linear and the layer ops) are module functions `<op>`,
each followed by its fake.
"""
import contextlib
import math
import weakref
from typing import NamedTuple

import torch

from . import _extension

_C = _extension.load("_C")
# The ops' limits and the meaning of each device-side error bit, defined once in the extension (csrc/checks/).
_CONSTANTS = _C.constants()
LIMITS = _CONSTANTS["limits"]
_ERROR_BITS = _CONSTANTS["error_bits"]
_SAMPLING_BITS = _CONSTANTS["sampling_bits"]

_INT64_MIN, _UINT64_END = -(2**63), 2**64
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# Temperatures below this (0 included) make a request greedy, on every backend and in the reference.
MIN_TEMPERATURE = LIMITS["min_temperature"]
_NARROW_INTS = (torch.int8, torch.int16, torch.uint8)  # widen to int32 exactly

# Each schema's fake kernel (output shapes and dtypes, nothing computed), by op name, so that torch.compile and fake
# tensors trace the ops; _register_fakes registers them for a namespace (specdec here, specdec_sim in specdec_ext.sim).
_FAKES: dict = {}


def _fake(op: str):
    """Records the decorated function as the fake kernel of schema `op`."""
    def record(fn):
        _FAKES[op] = fn
        return fn
    return record


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_frozen_scalar(value, name: str, op: str) -> None:
    """While a CUDA graph is captured, a Python number would be baked into the graph and replayed unchanged
    (a seed, an offset, a temperature): such arguments must be device tensors that the caller updates."""
    if not isinstance(value, torch.Tensor) and _capturing():
        raise ValueError(f"{op}: {name} is a Python {type(value).__name__} while a CUDA graph is being captured; "
                         "it would be frozen into the graph: pass a device tensor and update it between replays")


def _check_devices(op: str, device, what: str, **tensors) -> None:
    """Raises naming the tensor that is not on `device` (what: the name of the tensor that set it). Without this
    a tensor on another device (meta, say) would send the call to another backend's kernel."""
    for name, t in tensors.items():
        ts = t if isinstance(t, (list, tuple)) else [t]
        for i, x in enumerate(ts):
            if isinstance(x, torch.Tensor) and x.device != device:
                label = f"{name}[{i}]" if isinstance(t, (list, tuple)) else name
                raise ValueError(f"{op}: {label} is on {x.device} but {what} is on {device}")


def _as_int32(t: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """An integer tensor as contiguous int32, never narrowed silently: int32 as it is, int8/int16/uint8 widened,
    int64 checked to fit (a host read on CUDA: pass int32 there, and always while capturing a CUDA graph)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be an int32 tensor, got {type(t).__name__}")
    if t.dtype == torch.int32:
        return t.contiguous()
    if t.dtype in _NARROW_INTS:
        return t.to(torch.int32).contiguous()
    if t.dtype != torch.int64:
        raise ValueError(f"{op}: {name} must be an integer tensor (int32, or int64 within int32 range), got {t.dtype}")
    if _capturing():
        raise ValueError(f"{op}: {name} must be int32 while a CUDA graph is captured (int64 needs a range check)")
    if t.numel() and not _INT32_MIN <= int(t.min()) <= int(t.max()) <= _INT32_MAX:
        raise ValueError(f"{op}: {name} holds values outside the int32 range")
    return t.to(torch.int32).contiguous()


def _request_vector(value, name: str, op: str, batch: int | None, device) -> torch.Tensor:
    """A per-request int64 vector from an int (broadcast to the batch) or a 0-/1-D integer tensor."""
    _refuse_frozen_scalar(value, name, op)
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        raise TypeError(f"{op}: {name} must be an int or an integer tensor, got {type(value).__name__}")
    if isinstance(value, int):
        if not _INT64_MIN <= value < _UINT64_END:
            raise ValueError(f"{op}: {name} must fit in 64 bits, got {value}")
        if value >= 2**63:  # a uint64 seed: keep its bits
            value -= _UINT64_END
        return torch.full((1 if batch is None else batch,), value, dtype=torch.int64, device=device)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{op}: {name} must be an integer tensor, got {value.dtype}")
    if value.dim() > 1:
        raise ValueError(f"{op}: {name} must be a 0-D or 1-D tensor, got shape {tuple(value.shape)}")
    value = value.to(torch.int64).reshape(-1)
    if batch is not None and value.numel() == 1 and batch != 1:
        value = value.expand(batch)
    if batch is not None and value.numel() != batch:
        raise ValueError(f"{op}: {name} has {value.numel()} entries for a batch of {batch}")
    return value.contiguous()


def _philox_uniform(ops, seed, offset, n: int, stream: int = 0) -> torch.Tensor:
    op = "philox_uniform"
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 2**34:
        raise ValueError(f"{op}: n must be an int in [0, 2^34], got {n!r}")
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 2**32:
        raise ValueError(f"{op}: stream must be an int in [0, 2^32), got {stream!r}")
    tensors = [t for t in (seed, offset) if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    if any(t.device != device for t in tensors):
        raise ValueError(f"{op}: seed and offset must be on the same device, got {[str(t.device) for t in tensors]}")
    batch = next((t.numel() for t in tensors if t.dim() == 1), None)  # seed's length, else offset's
    seed = _request_vector(seed, "seed", op, batch, device)
    offset = _request_vector(offset, "offset", op, seed.numel(), device)
    return ops.philox_uniform(seed, offset, n, stream)


@_fake("philox_uniform")
def _philox_uniform_fake(seed, offset, n, stream=0):
    return seed.new_empty((seed.shape[0], n), dtype=torch.float32)


def _on_device(t) -> bool:
    """Whether t's kernels run on a device without host reads (CUDA): they record errors instead of raising."""
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


class SamplingOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, K+1] int32: accepted drafts, the resampled or bonus token, then -1
    num_accepted: torch.Tensor  # [B] int32; tokens emitted = num_accepted + 1


_strict = False


def set_strict(enabled: bool) -> None:
    """Strict mode, for debugging: every op raises on every invalid input, on every backend. On CUDA (and under
    the emulator) the kernels record what they find on the device and the call then reads it (a host
    synchronisation); the sampling ops also check every row each request owns, including rows the round
    never reads (NaN/Inf, target rows with no mass). Without it, CUDA leaves defined outputs for invalid
    requests (README), and the CPU kernels raise on everything they read."""
    global _strict
    _strict = bool(enabled)


def is_strict() -> bool:
    return _strict


def _error_flags(op: str, device, records_errors: bool):
    """The kernels' device-side error word, when strict mode asks for their device-side checks."""
    if not (records_errors and _strict):
        return None
    if _capturing():
        raise ValueError(f"{op}: strict mode reads the device's error word back, which a CUDA graph capture cannot; "
                         "call set_strict(False) before capturing")
    return torch.zeros(1, dtype=torch.int32, device=device)


def _describe_error_bits(bits: int, error_table: str, **names) -> str:
    """The messages of the error bits set in `bits`, from the extension's table for `error_table`, with the input
    names filled in, joined in the order of their bits (as the C++ messages are)."""
    return "; ".join(msg.format(**names) for bit, msg in sorted(_ERROR_BITS[error_table].items()) if bits & bit)


def _raise_recorded_errors(op: str, device, flags, error_table: str, **names) -> None:
    """Raises ValueError naming every error bit the kernel recorded in `flags`; the messages are the
    extension's table for `error_table`, with the input names filled in."""
    if flags is None:
        return
    bits = int(flags.item())  # the host sync that strict mode is for
    if bits:
        raise ValueError(f"{op}: invalid input detected on {device}: " +
                         _describe_error_bits(bits, error_table, **names))


@contextlib.contextmanager
def _kernel_errors_worded(op: str, flags, error_table: str, **names):
    """The CPU kernels raise in their schema's words; given `flags`, they also record their error bits there, and the
    refusal is raised again in the caller's words (op, names). flags is read only once a kernel has refused the call:
    a valid call reads nothing back."""
    try:
        yield
    except ValueError:
        bits = 0 if flags is None else int(flags.item())
        if not bits:
            raise
        raise ValueError(f"{op}: invalid input: " + _describe_error_bits(bits, error_table, **names)) from None


class _MessageNames(NamedTuple):
    """What a sampling op's messages call the op, its target rows, its draft rows and its offset: the schema's own
    names, or those of a function built on the op (gumbel_sample says positions and logits), so that its errors
    speak of its own arguments."""
    op: str
    target: str
    draft: str | None = None  # None: the caller takes no draft rows
    offset: str = "offset"


def _chain_names(logits: bool) -> _MessageNames:
    """The chain sampling schemas' own names, those the kernels' messages use."""
    if logits:
        return _MessageNames("chain_speculative_sampling_from_logits", "target_logits", "draft_logits")
    return _MessageNames("chain_speculative_sampling", "target_probs", "draft_probs")


def _per_request(value, name: str, op: str, batch: int, device, dtype) -> torch.Tensor:
    """A [B] tensor of `dtype` (int32, float32 or bool) on `device` from a Python scalar (broadcast) or a 0-/1-D
    tensor of the same kind: integers for int32 (checked to fit), real numbers for float32, bools for bool."""
    kind = {torch.int32: "an integer", torch.float32: "a real number", torch.bool: "a bool"}[dtype]
    _refuse_frozen_scalar(value, name, op)
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.numel() not in (1, batch):
            raise ValueError(f"{op}: {name} must be a scalar or have B = {batch} entries, got shape "
                             f"{tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{op}: {name} is on {value.device} but the inputs are on {device}")
        if dtype == torch.int32:
            value = _as_int32(value, name, op)
        elif (dtype == torch.bool) != (value.dtype == torch.bool) or value.dtype.is_complex:
            raise ValueError(f"{op}: {name} must be {kind} tensor, got {value.dtype}")
        return value.reshape(-1).to(dtype).expand(batch).contiguous()
    ok = {torch.int32: lambda v: isinstance(v, int) and not isinstance(v, bool) and _INT32_MIN <= v <= _INT32_MAX,
          torch.float32: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          torch.bool: lambda v: isinstance(v, bool)}[dtype]
    if not ok(value):
        raise ValueError(f"{op}: {name} must be {kind} (or a tensor of them), got {value!r}")
    return torch.full((batch,), value, dtype=dtype, device=device)


def _check_rows(op: str, tname: str, target, rows: list, owned_target, logits: bool) -> None:
    """Strict mode: each (name, x [B, R, V], owned [B, R]) of `rows` holds valid values in its owned rows, and every
    owned target row has mass, whether or not the op reads it."""
    for name, x, owned in rows:
        invalid = (x.isnan() | x.isposinf() if logits else ~x.isfinite()).any(-1)
        bad = (invalid & owned).nonzero()
        if len(bad):
            b, i = bad[0].tolist()
            raise ValueError(f"{op}: invalid input: {name}[{b}, {i}] holds NaN or +inf" +
                             ("" if logits else " (or -inf)"))
    best = target.amax(-1) if target.shape[-1] else torch.full(target.shape[:2], float("-inf"), device=target.device)
    empty = ~(best > (float("-inf") if logits else 0.0)) & owned_target
    if empty.any():
        b, i = empty.nonzero()[0].tolist()
        raise ValueError(f"{op}: invalid input: {tname}[{b}, {i}] has no mass (every logit -inf, or every "
                         "probability 0)")


def _check_every_row(op: str, tname: str, dname: str, target, draft, num_draft_tokens, k: int, bonus: bool,
                     logits: bool) -> None:
    """Strict mode, chain: the rows request b owns are target rows 0..num_draft_tokens[b] (below it with caller bonus
    tokens, whose bonus row is never read), draft rows below it."""
    counts = num_draft_tokens.clamp(0, k).unsqueeze(-1)
    positions = torch.arange(target.shape[1], device=target.device)
    owned_target = positions < counts if bonus else positions <= counts
    rows = [(tname, target, owned_target)]
    if draft is not None:
        rows.append((dname, draft, torch.arange(k, device=target.device) < counts))
    _check_rows(op, tname, target, rows, owned_target, logits)


def _sampling_controls(op: str, logits: bool, greedy_or_temperature, seed, offset, generator, batch: int, device,
                       offset_name: str = "offset"):
    """The sampling ops' per-request controls as [B] tensors on `device`: temperature (float32) or greedy (bool),
    seed (drawn from `generator` when None) and offset (called `offset_name` in messages)."""
    if logits:
        t = greedy_or_temperature
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            if not (t >= 0 and t != float("inf")):
                raise ValueError(f"{op}: temperature must be finite and >= 0, got {t}")
            if t > _FLOAT32_MAX:  # the kernels read float32, which has no larger finite value (1e39 is inf)
                raise ValueError(f"{op}: temperature must be finite and >= 0 in float32 (the kernels' type: at most "
                                 f"{_FLOAT32_MAX:.9g}), got {t}")
        control = _per_request(t, "temperature", op, batch, device, torch.float32)
    else:
        if greedy_or_temperature is None:  # omitted: not greedy, a constant the caller cannot mean to update
            control = torch.zeros(batch, dtype=torch.bool, device=device)
        else:
            control = _per_request(greedy_or_temperature, "greedy", op, batch, device, torch.bool)
    if seed is None:
        _refuse_frozen_scalar(None, "seed", op)  # a seed drawn now would be replayed unchanged
        gen_device = generator.device if generator is not None else device
        seed = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=generator, device=gen_device).to(device)
    else:
        seed = _request_vector(seed, "seed", op, batch, device)
    if offset is None:  # omitted: the Philox counter starts at 0, a constant (a caller under capture updates seed)
        return control, seed, torch.zeros(batch, dtype=torch.int64, device=device)
    return control, seed, _request_vector(offset, offset_name, op, batch, device)


def _float32_tensor(t, name: str, op: str, device):
    """A caller's float32 tensor (uniforms), contiguous, on `device`; None stays None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise ValueError(f"{op}: {name} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    _check_devices(op, device, "the rows", **{name: t})
    return t.contiguous()


# CPU maps already checked and inverted, by the map tensor's id: (a weak reference to it, a copy of its contents, V, the
# inverse). A decoder hands the same map every round; comparing it with the copy (one pass over Vd ids) is cheaper than
# checking and inverting it again. The copy, not the tensor's version counter, decides: a map rewritten through numpy
# or `.data` keeps its version, and the result must depend on the map's contents only.
_CHECKED_CPU_MAPS: dict = {}


def _target_to_draft(op: str, draft_to_target, vocab: int, draft, dname: str, device, flags):
    """The inverse of a reduced draft vocabulary's map: [V] int32, the draft column of each target id or -1. Built with
    device ops (no host read on CUDA, capturable); a map with an id outside [0, V) or an id twice raises on the CPU
    (checked again whenever the map's contents change) and sets the error word's bit in strict mode elsewhere (the
    kernels then see a map without those columns)."""
    if draft_to_target is None:
        return None
    cached = _CHECKED_CPU_MAPS.get(id(draft_to_target))
    if cached is not None and cached[0]() is draft_to_target and cached[2] == vocab and draft is not None and \
            draft.shape[-1] == draft_to_target.numel() and device.type == "cpu" and \
            cached[1].dtype == draft_to_target.dtype and torch.equal(cached[1], draft_to_target):
        return cached[3]
    if draft is None:
        raise ValueError(f"{op}: draft_to_target maps the columns of {dname}, which is None (point proposals)")
    if not isinstance(draft_to_target, torch.Tensor) or draft_to_target.dim() != 1:
        raise ValueError(f"{op}: draft_to_target must be a [Vd] integer tensor")
    if draft_to_target.numel() != draft.shape[-1]:
        raise ValueError(f"{op}: draft_to_target has {draft_to_target.numel()} entries but {dname} has "
                         f"{draft.shape[-1]} columns (Vd)")
    _check_devices(op, device, "the rows", draft_to_target=draft_to_target)
    if draft_to_target.dtype.is_floating_point or draft_to_target.dtype.is_complex or \
            draft_to_target.dtype == torch.bool:
        raise ValueError(f"{op}: draft_to_target must be an integer tensor, got {draft_to_target.dtype}")
    ids = draft_to_target.long()
    columns = torch.arange(ids.numel(), device=device)
    in_range = (ids >= 0) & (ids < vocab)
    # Slot V takes the ids out of range; where an id repeats, its lowest column wins (a deterministic map).
    inverse = torch.full((vocab + 1,), ids.numel(), dtype=torch.int64, device=device)
    inverse.scatter_reduce_(0, torch.where(in_range, ids, vocab), columns, reduce="amin")
    valid = in_range & (inverse[ids.clamp(0, vocab)] == columns)
    if device.type == "cpu":
        if not bool(valid.all()):
            j = int((~valid).nonzero()[0, 0])
            x = int(ids[j])
            why = f"outside [0, V = {vocab})" if not 0 <= x < vocab else "an id an earlier column already maps to"
            raise ValueError(f"{op}: draft_to_target[{j}] = {x} is {why}: the map must hold distinct target ids")
    elif flags is not None:
        flags |= (~valid).any().int() * _SAMPLING_BITS["draft_to_target"]
    inverse = torch.where(inverse[:vocab] < ids.numel(), inverse[:vocab], -1).to(torch.int32)
    if device.type == "cpu":
        for key in [k for k, v in _CHECKED_CPU_MAPS.items() if v[0]() is None]:
            del _CHECKED_CPU_MAPS[key]
        _CHECKED_CPU_MAPS[id(draft_to_target)] = (weakref.ref(draft_to_target), draft_to_target.clone(), vocab, inverse)
    return inverse


def _flat_form(op: str, cu_num_draft_tokens, max_draft_tokens, counts, counts_name: str, device, tname: str):
    """The flat form's (cu_num_draft_tokens as int32, B, max_draft_tokens), checked: cu a [B] integer tensor on
    `device`, max_draft_tokens a host int in range, and no padded-form counts besides (`counts`: the trees' num_nodes;
    the chain ops pass None, their num_draft_tokens being a cap in the flat form)."""
    if counts is not None:
        raise ValueError(f"{op}: {counts_name} and cu_num_draft_tokens are two forms of one thing: pass one")
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int) or \
            not 0 <= max_draft_tokens <= LIMITS["max_draft_tokens"]:
        raise ValueError(f"{op}: max_draft_tokens must be a Python int in [0, {LIMITS['max_draft_tokens']}] with "
                         f"cu_num_draft_tokens (the output width less one; a host int keeps the call capturable), "
                         f"got {max_draft_tokens!r}")
    if not isinstance(cu_num_draft_tokens, torch.Tensor) or cu_num_draft_tokens.dim() != 1:
        raise ValueError(f"{op}: cu_num_draft_tokens must be a [B] int32 tensor (inclusive cumulative sum)")
    _check_devices(op, device, tname, cu_num_draft_tokens=cu_num_draft_tokens)
    cu = _as_int32(cu_num_draft_tokens, "cu_num_draft_tokens", op)
    return cu, cu.numel(), max_draft_tokens


def _check_out_shape(op: str, t: torch.Tensor, name: str, shape: tuple, spelled: str) -> None:
    """An `out=` tensor of the flat form, whose width the op cannot check against max_draft_tokens (its schema has no
    such argument): shape `shape`, spelled in the message as `spelled`."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: out's {name} must be {spelled} = {list(shape)} in the flat form, got {list(t.shape)}")


COUPLINGS = ("rejection", "gumbel")
VERIFICATIONS = ("token", "block")


_ROW_FILTER_RANGES = {"top_k": (lambda v: v >= 0, ">= 0 (0: off)"),
                      "top_p": (lambda v: (v > 0) & (v <= 1), "in (0, 1] (1: off)"),
                      "min_p": (lambda v: (v >= 0) & (v < 1), "in [0, 1) (0: off)")}
# The kernels' one message for an out-of-range entry of any of the three (the error word's row-filter bit).
_ROW_FILTER_ERROR = next(m for m in _ERROR_BITS["chain_speculative_sampling"].values() if m.startswith("top_k must"))


def _row_filters(op: str, top_k, top_p, min_p, batch: int, device) -> tuple:
    """The from-logits ops' logits processing as [B] tensors (top_k int32, top_p and min_p float32), None where not
    given. Python scalars are checked here; a tensor's entries are checked by the kernels (the CPU raises, CUDA in
    strict mode, named by _row_filter_errors_named), which otherwise process an invalid request's rows as if no
    control were given."""
    out = []
    for name, value, dtype in (("top_k", top_k, torch.int32), ("top_p", top_p, torch.float32),
                               ("min_p", min_p, torch.float32)):
        valid, spelled = _ROW_FILTER_RANGES[name]
        if value is not None and not isinstance(value, torch.Tensor) and not isinstance(value, bool) and \
                isinstance(value, (int, float)) and not valid(value):
            raise ValueError(f"{op}: {name} must be {spelled}, got {value}")
        out.append(None if value is None else _per_request(value, name, op, batch, device, dtype))
    return tuple(out)


@contextlib.contextmanager
def _row_filter_errors_named(op: str, filters: tuple):
    """The kernels refuse an out-of-range top_k / top_p / min_p entry with one message for the three; once refused,
    the entries are read (only then: a valid call reads nothing back) and the message names the control and the
    request."""
    try:
        yield
    except ValueError as e:
        if _ROW_FILTER_ERROR not in str(e):
            raise
        for name, value in zip(("top_k", "top_p", "min_p"), filters):
            valid, spelled = _ROW_FILTER_RANGES[name]
            bad = None if value is None else (~valid(value)).nonzero()
            if bad is not None and bad.numel():
                b = int(bad[0, 0])
                raise ValueError(f"{op}: {name} must be {spelled}, got {name}[{b}] = {value[b].item()} "
                                 f"(request {b})") from None
        raise


def _check_coupling(op: str, coupling, draft, dname: str, uniforms, final_uniforms) -> None:
    """coupling="gumbel" decides every row by its own Gumbel-max token: it takes no draft rows and no caller uniforms
    (the drafts are assumed drawn with the same noise, by gumbel_sample or the decoder's drafters)."""
    if coupling not in COUPLINGS:
        raise ValueError(f"{op}: coupling must be one of {COUPLINGS}, got {coupling!r}")
    if coupling == "gumbel":
        if draft is not None:
            raise ValueError(f"{op}: coupling='gumbel' reads no draft rows (a draft is accepted when it equals the "
                             f"target's Gumbel-max token); pass {dname}=None")
        for name, value in (("uniforms", uniforms), ("final_uniforms", final_uniforms)):
            if value is not None:
                raise ValueError(f"{op}: coupling='gumbel' draws its noise from (seed, position); {name} must be None")


def _check_verification(op: str, verification, coupling, accepted_independently) -> None:
    """verification="block" (Sun et al. 2024) judges a sampled request's drafts jointly by their probabilities: not with
    coupling="gumbel" (which takes none), nor with accepted_independently (FlashInfer's token-wise count)."""
    if not isinstance(verification, str) or verification not in VERIFICATIONS:
        raise ValueError(f"{op}: verification must be one of {VERIFICATIONS}, got {verification!r}")
    if verification == "block":
        if coupling == "gumbel":
            raise ValueError(f"{op}: verification='block' judges the drafts by their probabilities, which "
                             "coupling='gumbel' does not take: use verification='token' with it")
        if accepted_independently is not None:
            raise ValueError(f"{op}: accepted_independently is FlashInfer's token-by-token count, which "
                             "verification='block' does not define: pass accepted_independently=None")


def _check_normalizers(op: str, device, tname: str, target_lse, draft_lse) -> None:
    """The caller normalisers are tensors (or None) on the rows' device; the kernels check their shapes."""
    for name, t in (("target_lse", target_lse), ("draft_lse", draft_lse)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a float32 tensor or None, got {type(t).__name__}")
    _check_devices(op, device, tname, target_lse=target_lse, draft_lse=draft_lse)


def _chain_sampling(ops, draft_token_ids, target, draft, *, logits, num_draft_tokens, greedy_or_temperature, seed,
                    offset, generator, out, cu_num_draft_tokens, max_draft_tokens, bonus_token_ids, uniforms,
                    final_uniforms, draft_to_target, accepted_independently, coupling, records_errors,
                    top_k=None, top_p=None, min_p=None, names: _MessageNames | None = None,
                    verification="token", target_lse=None, draft_lse=None, row_lse=None) -> SamplingOutput:
    """The chain ops' checks and defaults, then the schema; names: the caller's words for its messages (default the
    schema's)."""
    schema_names = _chain_names(logits)
    names = names or schema_names
    op, tname = names.op, names.target
    dname = names.draft or schema_names.draft  # a caller without draft rows passes none: the name is never said
    _check_coupling(op, coupling, draft, dname, uniforms, final_uniforms)
    _check_verification(op, verification, coupling, accepted_independently)
    flat = cu_num_draft_tokens is not None
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: {tname} must be a tensor, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, torch.Tensor):
        raise TypeError(f"{op}: {dname} must be a tensor or None, got {type(draft).__name__}")
    device = target.device
    if flat:
        if not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dim() != 1:
            raise ValueError(f"{op}: draft_token_ids must be a [T] tensor with cu_num_draft_tokens (the flat form)")
        # num_draft_tokens, when given, caps the drafts each request judges (checked against cu by the kernels).
        cu_num_draft_tokens, batch, k = _flat_form(op, cu_num_draft_tokens, max_draft_tokens, None,
                                                   "num_draft_tokens", device, tname)
    else:
        if max_draft_tokens is not None:
            raise ValueError(f"{op}: max_draft_tokens goes with cu_num_draft_tokens (the flat form)")
        if not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dim() != 2:
            raise ValueError(f"{op}: draft_token_ids must be a [B, K] tensor (or [T] with cu_num_draft_tokens)")
        batch, k = draft_token_ids.shape
        if k > LIMITS["max_draft_tokens"]:
            raise ValueError(f"{op}: at most {LIMITS['max_draft_tokens']} draft tokens per request, got K = {k}")
    _check_devices(op, device, tname, draft_token_ids=draft_token_ids, **{dname: draft})
    _check_normalizers(op, device, tname, target_lse, draft_lse)
    if not flat:
        num_draft_tokens = torch.full((batch,), k, dtype=torch.int32, device=device) if num_draft_tokens is None else \
            _per_request(num_draft_tokens, "num_draft_tokens", op, batch, device, torch.int32)
    elif num_draft_tokens is not None:
        num_draft_tokens = _per_request(num_draft_tokens, "num_draft_tokens", op, batch, device, torch.int32)
    if bonus_token_ids is not None:
        if not isinstance(bonus_token_ids, torch.Tensor) or bonus_token_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: bonus_token_ids must be a [B] int32 or int64 tensor")
        _check_devices(op, device, tname, bonus_token_ids=bonus_token_ids)
        bonus_token_ids = bonus_token_ids.reshape(-1).contiguous()  # vLLM hands [B, 1]
    uniforms = _float32_tensor(uniforms, "uniforms", op, device)
    final_uniforms = _float32_tensor(final_uniforms, "final_uniforms", op, device)
    control, seed, offset = _sampling_controls(op, logits, greedy_or_temperature, seed, offset, generator, batch,
                                               device, names.offset)
    _check_devices(op, device, tname, seed=seed, **{names.offset: offset})
    if out is None:
        out = SamplingOutput(torch.empty((batch, k + 1), dtype=torch.int32, device=device),
                             torch.empty((batch,), dtype=torch.int32, device=device))
    elif not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise ValueError(f"{op}: out must be a tuple (output_token_ids [B, K+1] int32, num_accepted [B] int32)")
    out = SamplingOutput(*out)
    _check_devices(op, device, tname, output_token_ids=out.output_token_ids, num_accepted=out.num_accepted,
                   accepted_independently=accepted_independently)
    if flat:  # the op reads K off output_token_ids' width: it must be max_draft_tokens + 1
        _check_out_shape(op, out.output_token_ids, "output_token_ids", (batch, k + 1), "[B, max_draft_tokens + 1]")
    flags = _error_flags(op, device, records_errors)
    # A kernel that raises (the CPU's) words its refusal in the schema's names: for a caller with names of its own it
    # also records the error bits, which are then worded in the caller's.
    cpu_flags = torch.zeros(1, dtype=torch.int32, device=device) if names != schema_names and not records_errors \
        else None
    kernel_flags = flags if cpu_flags is None else cpu_flags
    target_to_draft = _target_to_draft(op, draft_to_target, target.shape[-1], draft, dname, device, flags)
    filters = _row_filters(op, top_k, top_p, min_p, batch, device) if logits else (None, None, None)
    with _row_filter_errors_named(op, filters), \
            _kernel_errors_worded(op, cpu_flags, "chain_speculative_sampling", target=tname, draft=dname):
        if logits:
            ops.chain_speculative_sampling_from_logits(
                draft_token_ids, target, draft, num_draft_tokens, control, seed, offset, out.output_token_ids,
                out.num_accepted, kernel_flags, cu_num_draft_tokens, bonus_token_ids, uniforms, final_uniforms,
                target_to_draft, accepted_independently, coupling, *filters, verification, target_lse, draft_lse,
                _strict, row_lse)
        else:
            ops.chain_speculative_sampling(draft_token_ids, target, draft, num_draft_tokens, control, seed, offset,
                                           out.output_token_ids, out.num_accepted, kernel_flags, cu_num_draft_tokens,
                                           bonus_token_ids, uniforms, final_uniforms, target_to_draft,
                                           accepted_independently, coupling, verification)
        _raise_recorded_errors(op, device, flags, "chain_speculative_sampling", target=tname, draft=dname)
    if _strict and row_lse is None and not flat and target.dim() == 3 and target.shape[0] and not _capturing():
        _check_every_row(op, tname, dname, target, draft, num_draft_tokens, k, bonus_token_ids is not None, logits)
    return out


@_fake("chain_speculative_sampling")
def _chain_speculative_sampling_fake(*args, **kwargs):
    """Writes only its outputs (output_token_ids, num_accepted, accepted_independently, error_flags)."""


@_fake("chain_speculative_sampling_from_logits")
def _chain_speculative_sampling_from_logits_fake(*args, **kwargs):
    """Writes only its outputs, as chain_speculative_sampling."""


def _sample_without_drafts(ops, logits, *, temperature, seed, offset, coupling, top_k, top_p, min_p, out,
                           records_errors, names: _MessageNames) -> torch.Tensor:
    """One token per row of logits [B, V] from the chain op from logits with K = 1 and no draft proposed: the bonus
    token of row 0 at `offset`. names: the caller's words (op, logits, offset) for every message, its own checks and
    the chain op's alike."""
    op, lname = names.op, names.target
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"{op}: {lname} must be a [B, V] tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    batch, vocab = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: {lname} must be float32, bfloat16 or float16, got {logits.dtype}")
    # The kernels' checks of the rows, made here so that they too are said in the caller's words.
    if not 1 <= vocab <= LIMITS["max_vocab"]:
        raise ValueError(f"{op}: the vocabulary size V must be in [1, {LIMITS['max_vocab']}], got {vocab}")
    if logits.stride(-1) != 1:
        raise ValueError(f"{op}: {lname} must be contiguous in its last (vocabulary) dimension")
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == (batch,) and out.dtype == torch.int32
                                and out.device == logits.device):
        raise ValueError(f"{op}: out must be a [B] = [{batch}] int32 tensor on {logits.device}")
    # Row 1, the bonus row were the draft accepted, is never read: the rows are logits itself twice (stride 0, no
    # copy, capturable in a CUDA graph).
    rows = _chain_sampling(ops, torch.zeros((batch, 1), dtype=torch.int32, device=logits.device),
                           logits.unsqueeze(1).expand(batch, 2, vocab), None, logits=True,
                           num_draft_tokens=torch.zeros((batch,), dtype=torch.int32, device=logits.device),
                           greedy_or_temperature=temperature, seed=seed, offset=offset, generator=None, out=None,
                           cu_num_draft_tokens=None, max_draft_tokens=None, bonus_token_ids=None, uniforms=None,
                           final_uniforms=None, draft_to_target=None, accepted_independently=None, coupling=coupling,
                           records_errors=records_errors, top_k=top_k, top_p=top_p, min_p=min_p, names=names)
    if out is None:
        return rows.output_token_ids[:, 0]
    out.copy_(rows.output_token_ids[:, 0])
    return out


def _logits_normalizer(ops, logits, *, temperature, top_k, top_p, min_p, records_errors) -> torch.Tensor:
    """logits_normalizer: the chain op from logits with K = 0 over the rows [R, 1, V], each row its own request, and
    row_lse [R]: the kernels' statistics pass of target row 0, nothing sampled."""
    op = "logits_normalizer"
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"{op}: logits must be a [..., V] tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, 1, vocab)

    def per_row(value, name: str):
        if not isinstance(value, torch.Tensor):
            return value
        if value.shape != shape:
            raise ValueError(f"{op}: {name} must be a float, or a tensor of logits' shape less V {tuple(shape)}, "
                             f"got {tuple(value.shape)}")
        return value.reshape(-1)

    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    # No draw is made: seed and offset are device zeros (a Python int would be refused under CUDA graph capture).
    unused = torch.zeros(rows.shape[0], dtype=torch.int64, device=logits.device)
    _chain_sampling(ops, torch.zeros((rows.shape[0], 0), dtype=torch.int32, device=logits.device), rows, None,
                    logits=True, num_draft_tokens=None, greedy_or_temperature=per_row(temperature, "temperature"),
                    seed=unused, offset=unused, generator=None, out=None, cu_num_draft_tokens=None,
                    max_draft_tokens=None,
                    bonus_token_ids=None, uniforms=None, final_uniforms=None, draft_to_target=None,
                    accepted_independently=None, coupling="rejection", records_errors=records_errors,
                    top_k=per_row(top_k, "top_k"), top_p=per_row(top_p, "top_p"), min_p=per_row(min_p, "min_p"),
                    names=_MessageNames(op, "logits"), row_lse=out)
    return out.reshape(shape)


class TreeSamplingOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, N] int32: the accepted nodes' tokens, the resampled or bonus token, then -1
    accepted_nodes: torch.Tensor  # [B, N] int32: the accepted path's nodes from the root (0), then -1
    num_accepted: torch.Tensor  # [B] int32: accepted nodes below the root; tokens emitted = num_accepted + 1


def _check_every_tree_row(op: str, tname: str, dname: str, target, draft, parents, num_nodes, logits: bool) -> None:
    """Strict mode, tree: the rows request b owns are its target rows below num_nodes[b] and the draft rows of
    its nodes with children."""
    n = target.shape[1]
    owned = torch.arange(n, device=target.device) < num_nodes.clamp(1, n).unsqueeze(-1)
    rows = [(tname, target, owned)]
    if draft is not None:
        child = (owned & (parents >= 0)).int()
        rows.append((dname, draft, torch.zeros_like(child).scatter_add_(1, parents.long().clamp(0, n - 1), child) > 0))
    _check_rows(op, tname, target, rows, owned, logits)


def _tree_sampling(ops, parents, candidate_token_ids, target, draft, *, logits, num_nodes, greedy_or_temperature,
                   seed, offset, generator, out, uniforms, final_uniforms, draft_to_target, cu_num_draft_tokens,
                   max_draft_tokens, coupling, records_errors, top_k=None, top_p=None,
                   min_p=None, target_lse=None, draft_lse=None) -> TreeSamplingOutput:
    op = "tree_speculative_sampling_from_logits" if logits else "tree_speculative_sampling"
    tname = "target_logits" if logits else "target_probs"
    dname = "draft_logits" if logits else "draft_probs"
    _check_coupling(op, coupling, draft, dname, uniforms, final_uniforms)
    flat = cu_num_draft_tokens is not None
    for name, t in (("parents", parents), ("candidate_token_ids", candidate_token_ids)):
        if not isinstance(t, torch.Tensor) or t.dim() != (1 if flat else 2):
            raise ValueError(f"{op}: {name} must be a " +
                             ("[T + B] tensor in the flat form" if flat else "[B, N] tensor"))
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: {tname} must be a tensor, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, torch.Tensor):
        raise TypeError(f"{op}: {dname} must be a tensor or None, got {type(draft).__name__}")
    if flat:
        cu_num_draft_tokens, batch, n = _flat_form(op, cu_num_draft_tokens, max_draft_tokens, num_nodes, "num_nodes",
                                                   target.device, tname)
        n += 1  # the root
    else:
        if max_draft_tokens is not None:
            raise ValueError(f"{op}: max_draft_tokens goes with cu_num_draft_tokens (the flat form)")
        batch, n = parents.shape
    if not 1 <= n <= LIMITS["max_tree_nodes"]:
        raise ValueError(f"{op}: the number of tree nodes N must be in [1, {LIMITS['max_tree_nodes']}], got {n}")
    if candidate_token_ids.shape != parents.shape:
        raise ValueError(f"{op}: candidate_token_ids must have the shape of parents {tuple(parents.shape)}, got "
                         f"{tuple(candidate_token_ids.shape)}")
    device = target.device
    _check_devices(op, device, tname, parents=parents, candidate_token_ids=candidate_token_ids, **{dname: draft})
    _check_normalizers(op, device, tname, target_lse, draft_lse)
    parents = _as_int32(parents, "parents", op).contiguous()
    if candidate_token_ids.dtype not in (torch.int32, torch.int64):
        candidate_token_ids = _as_int32(candidate_token_ids, "candidate_token_ids", op)
    candidate_token_ids = candidate_token_ids.contiguous()
    if not flat:
        num_nodes = torch.full((batch,), n, dtype=torch.int32, device=device) if num_nodes is None else \
            _per_request(num_nodes, "num_nodes", op, batch, device, torch.int32)
    control, seed, offset = _sampling_controls(op, logits, greedy_or_temperature, seed, offset, generator, batch,
                                               device)
    uniforms = _float32_tensor(uniforms, "uniforms", op, device)
    final_uniforms = _float32_tensor(final_uniforms, "final_uniforms", op, device)
    if out is None:
        out = TreeSamplingOutput(torch.empty((batch, n), dtype=torch.int32, device=device),
                                 torch.empty((batch, n), dtype=torch.int32, device=device),
                                 torch.empty((batch,), dtype=torch.int32, device=device))
    elif not (isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        raise ValueError(f"{op}: out must be a tuple (output_token_ids [B, N] int32, accepted_nodes [B, N] int32, "
                         "num_accepted [B] int32)")
    out = TreeSamplingOutput(*out)
    _check_devices(op, device, tname, output_token_ids=out.output_token_ids, accepted_nodes=out.accepted_nodes,
                   num_accepted=out.num_accepted)
    if flat:  # the op reads N off the outputs' width: it must be max_draft_tokens + 1
        for name in ("output_token_ids", "accepted_nodes"):
            _check_out_shape(op, getattr(out, name), name, (batch, n), "[B, max_draft_tokens + 1]")
    flags = _error_flags(op, device, records_errors)
    target_to_draft = _target_to_draft(op, draft_to_target, target.shape[-1], draft, dname, device, flags)
    filters = _row_filters(op, top_k, top_p, min_p, batch, device) if logits else (None, None, None)
    with _row_filter_errors_named(op, filters):
        if logits:
            ops.tree_speculative_sampling_from_logits(
                parents, candidate_token_ids, num_nodes, target, draft, control, seed, offset, *out, flags, uniforms,
                final_uniforms, target_to_draft, cu_num_draft_tokens, coupling, *filters, target_lse, draft_lse,
                _strict)
        else:
            ops.tree_speculative_sampling(parents, candidate_token_ids, num_nodes, target, draft, control, seed,
                                          offset, *out, flags, uniforms, final_uniforms, target_to_draft,
                                          cu_num_draft_tokens, coupling)
        _raise_recorded_errors(op, device, flags, "tree_speculative_sampling", target=tname, draft=dname)
    if _strict and not flat and target.dim() == 3 and target.shape[0] and not _capturing():
        _check_every_tree_row(op, tname, dname, target, draft, parents, num_nodes, logits)
    return out


@_fake("tree_speculative_sampling")
def _tree_speculative_sampling_fake(*args, **kwargs):
    """Writes only its outputs (output_token_ids, accepted_nodes, num_accepted, error_flags)."""


@_fake("tree_speculative_sampling_from_logits")
def _tree_speculative_sampling_from_logits_fake(*args, **kwargs):
    """Writes only its outputs, as tree_speculative_sampling."""


def _layers(caches, name: str) -> list:
    """A list of per-layer caches from a list/tuple or one stacked [L, ...] tensor."""
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 5:
            raise ValueError(f"truncate_kv_cache: a stacked {name} must be [L, ...] with 4-D layers, got "
                             f"{tuple(caches.shape)}")
        return list(caches.unbind(0))
    caches = list(caches)
    if not all(isinstance(c, torch.Tensor) for c in caches):
        raise TypeError(f"truncate_kv_cache: {name} must be tensors")
    return caches


def _truncate_kv_cache(ops, cache_seqlens, num_kept, *, block_len, kept_indices, k_caches, v_caches, block_table, clear,
                       kv_layout, kv_indptr, kv_indices, records_errors) -> None:
    op = "truncate_kv_cache"
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cache_seqlens must be a [B] int32 tensor")
    batch, device = cache_seqlens.numel(), cache_seqlens.device
    if block_len is not None and (isinstance(block_len, bool) or not isinstance(block_len, int)):
        raise ValueError(f"{op}: block_len must be an int or None, got {block_len!r}")
    if kept_indices is not None:
        if not isinstance(kept_indices, torch.Tensor) or kept_indices.dim() != 2:
            raise ValueError(f"{op}: kept_indices must be a [B, block_len] int32 tensor")
        if block_len is not None and block_len != kept_indices.shape[1]:
            raise ValueError(f"{op}: block_len {block_len} disagrees with kept_indices' {kept_indices.shape[1]} "
                             "columns")
        block_len = kept_indices.shape[1]
        kept_indices = _as_int32(kept_indices, "kept_indices", op)
    if block_len is None and clear:
        raise ValueError(f"{op}: block_len is needed with clear=True")
    num_kept = _per_request(num_kept, "num_kept", op, batch, device, torch.int32)
    k_caches, v_caches = _layers(k_caches, "k_caches"), _layers(v_caches, "v_caches")
    if block_table is not None:
        block_table = _as_int32(block_table, "block_table", op)
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f'{op}: kv_layout must be "NHD" or "HND", got {kv_layout!r}')
    if (kv_indptr is None) != (kv_indices is None):
        raise ValueError(f"{op}: kv_indptr and kv_indices go together (FlashInfer's CSR page table)")
    if kv_indptr is not None:
        if block_table is not None:
            raise ValueError(f"{op}: give block_table or the CSR table (kv_indptr, kv_indices), not both")
        for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"{op}: {name} must be a 1-D int32 tensor")
        kv_indptr, kv_indices = _as_int32(kv_indptr, "kv_indptr", op), _as_int32(kv_indices, "kv_indices", op)
    _check_devices(op, device, "cache_seqlens", kept_indices=kept_indices, k_caches=k_caches, v_caches=v_caches,
                   block_table=block_table, kv_indptr=kv_indptr, kv_indices=kv_indices)
    flags = _error_flags(op, device, records_errors)
    ops.truncate_kv_cache(cache_seqlens, num_kept, kept_indices, k_caches, v_caches, block_table, block_len,
                          bool(clear), flags, kv_indptr, kv_indices, kv_layout)
    _raise_recorded_errors(op, device, flags, "truncate_kv_cache")


@_fake("truncate_kv_cache")
def _truncate_kv_cache_fake(*args, **kwargs):
    """Writes only in place (cache_seqlens, the caches, error_flags)."""


def _index_vector(t, name: str, op: str, device):
    """An int32 index tensor (qo_indptr, kv_indptr, ...) on `device`, or None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{op}: {name} must be a 1-D int32 tensor, got {getattr(t, 'shape', type(t).__name__)}")
    _check_devices(op, device, "q", **{name: t})
    return _as_int32(t, name, op)


def _check_indptr(op: str, name: str, indptr, end: int, end_name: str, limit=None) -> None:
    """CPU only (the kernels check on the device, strict mode raises): indptr starts >= 0, does not decrease and
    ends <= end; with `limit`, no entry is wider than it."""
    if indptr.device.type != "cpu" or indptr.numel() == 0:
        return
    widths = indptr[1:] - indptr[:-1]
    if int(indptr[0]) < 0 or (widths < 0).any():
        raise ValueError(f"{op}: {name} must start at >= 0 and not decrease, got {indptr.tolist()[:16]}")
    if int(indptr[-1]) > end:
        raise ValueError(f"{op}: {name} runs past {end_name} ({int(indptr[-1])} > {end})")
    if limit is not None and widths.numel() and int(widths.max()) > limit:
        raise ValueError(f"{op}: {name} gives a request {int(widths.max())} rows, at most {limit}")


def _verify_attention(ops, q, k_cache, v_cache, cache_seqlens, k_new, v_new, *, block_table, tree_mask, softmax_scale,
                      return_lse, qo_indptr, kv_layout, kv_indptr, kv_indices, kv_last_page_len, window_left,
                      logits_soft_cap, out, records_errors):
    op = "verify_attention"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cache_seqlens must be a tensor, got {type(cache_seqlens).__name__}")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f'{op}: kv_layout must be "NHD" or "HND", got {kv_layout!r}')
    if tree_mask is not None:
        if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool:
            raise ValueError(f"{op}: tree_mask must be a bool tensor (True: query i sees new token j), got "
                             f"{getattr(tree_mask, 'dtype', type(tree_mask).__name__)}; an additive float mask "
                             "(0 / -inf) means the inverse: pass mask == 0")
        tree_mask = tree_mask.contiguous()
    if block_table is not None:
        block_table = _as_int32(block_table, "block_table", op)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or \
                not (0 < softmax_scale < math.inf):
            raise ValueError(f"{op}: softmax_scale must be a finite number > 0 (or None for 1/sqrt(D)), "
                             f"got {softmax_scale!r}")
        softmax_scale = float(softmax_scale)
    if isinstance(window_left, bool) or not isinstance(window_left, int) or not -1 <= window_left <= _INT32_MAX:
        raise ValueError(f"{op}: window_left must be an int, -1 (off) or >= 0, got {window_left!r}")
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)) or \
            not 0 <= logits_soft_cap < math.inf:
        raise ValueError(f"{op}: logits_soft_cap must be a finite number >= 0 (0: off), got {logits_soft_cap!r}")
    qo_indptr = _index_vector(qo_indptr, "qo_indptr", op, q.device)
    kv_indptr = _index_vector(kv_indptr, "kv_indptr", op, q.device)
    kv_indices = _index_vector(kv_indices, "kv_indices", op, q.device)
    kv_last_page_len = _index_vector(kv_last_page_len, "kv_last_page_len", op, q.device)
    if kv_indptr is not None:
        if block_table is not None:
            raise ValueError(f"{op}: give block_table or the CSR table (kv_indptr, kv_indices, kv_last_page_len), "
                             "not both")
        if kv_indices is None or kv_last_page_len is None:
            raise ValueError(f"{op}: kv_indptr needs kv_indices and kv_last_page_len")
        if cache_seqlens is not None:
            raise ValueError(f"{op}: cache_seqlens must be None with kv_indptr: the lengths come from the CSR table "
                             "(FlashInfer's kv length, (pages - 1) * page_size + kv_last_page_len, includes the Q_b "
                             "new tokens)")
        _check_indptr(op, "kv_indptr", kv_indptr, kv_indices.numel(), "kv_indices")
    elif kv_indices is not None or kv_last_page_len is not None:
        raise ValueError(f"{op}: kv_indices and kv_last_page_len need kv_indptr")
    elif cache_seqlens is None:
        raise ValueError(f"{op}: cache_seqlens is needed (unless the CSR table kv_indptr is given)")
    if qo_indptr is not None:
        if q.dim() != 3:
            raise ValueError(f"{op}: with qo_indptr, q must be flat [T, Hq, D], got {tuple(q.shape)}")
        _check_indptr(op, "qo_indptr", qo_indptr, q.shape[0], "T (q's rows)", LIMITS["max_verify_queries"])
    _check_devices(op, q.device, "q", k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k_new=k_new,
                   v_new=v_new, block_table=block_table, tree_mask=tree_mask, out=out)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous {q.dtype} tensor of q's shape {tuple(q.shape)}, got "
                         f"{getattr(out, 'shape', type(out).__name__)}")
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if return_lse else None
    flags = _error_flags(op, q.device, records_errors)
    ops.verify_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask, softmax_scale, out,
                         lse, flags, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_layout, window_left,
                         float(logits_soft_cap))
    _raise_recorded_errors(op, q.device, flags, "verify_attention")
    return (out, lse) if return_lse else out


@_fake("verify_attention")
def _verify_attention_fake(*args, **kwargs):
    """Writes only its outputs (out, lse, error_flags) and the caches (k_new appended)."""


# GGUF block formats the quantised GEMM reads (GGML type ids) -> (weights, bytes) per block.
QUANTIZED_FORMATS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210)}


def _check_blocks(op: str, qweight, format) -> int:
    """K of a [N, row_bytes] uint8 block tensor in `format`; raises naming the argument."""
    if isinstance(format, bool) or not isinstance(format, int) or format not in QUANTIZED_FORMATS:
        raise ValueError(f"{op}: format must be a GGUF block type id (Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q6_K 14), "
                         f"got {format!r}")
    weights, nbytes = QUANTIZED_FORMATS[format]
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.uint8 or qweight.dim() != 2 or \
            qweight.shape[1] == 0 or qweight.shape[1] % nbytes:
        shape = tuple(qweight.shape) if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise ValueError(f"{op}: qweight must be a uint8 [N, row_bytes] tensor with row_bytes a multiple of {nbytes} "
                         f"(format {format}'s block), got {shape}")
    return qweight.shape[1] // nbytes * weights


def _quantized_linear(ops, x, qweight, format: int, bias, activations: str) -> torch.Tensor:
    k = _check_blocks("quantized_linear", qweight, format)
    if activations not in ("float", "int8"):
        raise ValueError(f'quantized_linear: activations must be "float" or "int8", got {activations!r}')
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"quantized_linear: x must be [..., {k}] (qweight's columns), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    _check_devices("quantized_linear", x.device, "x", qweight=qweight, bias=bias)
    rows = x.reshape(-1, k)
    if rows.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))
    return ops.quantized_linear(rows, qweight.contiguous(), format, bias, activations).reshape(*x.shape[:-1],
                                                                                               qweight.shape[0])


@_fake("quantized_linear")
def _quantized_linear_fake(x, qweight, format, bias, activations="float"):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _dequantize(ops, qweight, format: int) -> torch.Tensor:
    _check_blocks("dequantize", qweight, format)
    return ops.dequantize(qweight.contiguous(), format)


@_fake("dequantize")
def _dequantize_fake(qweight, format):
    weights, nbytes = QUANTIZED_FORMATS.get(format, (1, 1))
    return qweight.new_empty((qweight.shape[0], qweight.shape[1] // nbytes * weights), dtype=torch.float32)


class Ops:
    """The ops of docs/design.md §3 on one backend, each defined once: `namespace` is torch.ops.specdec (the CPU and
    CUDA kernels; the module-level functions of specdec_ext) or torch.ops.specdec_sim (the CUDA kernels' source
    under the emulator; specdec_ext.sim). records_errors(tensor) says whether the kernels for that tensor record
    invalid input on the device (CUDA, the emulator) instead of raising (the CPU kernels)."""

    def __init__(self, namespace, records_errors):
        self.namespace = namespace
        self.records_errors = records_errors

    def philox_uniform(self, seed, offset, n: int, stream: int = 0) -> torch.Tensor:
        """Uniforms in the open interval (0, 1) from counter-based Philox4x32-10.

        The random stream that every sampling op of this library draws from (RNG contract, docs/design.md §3.1):
        stream 0 holds the acceptance tests' uniforms, stream 1 the resampled or bonus token's, stream 2 the
        Gumbel noise of coupling="gumbel".

        Parameters
        ----------
        seed : torch.Tensor or int
            [B] integer tensor, or an int (broadcast): each request's key (uint64 bits kept).
        offset : torch.Tensor or int
            [B] integer tensor, or an int (broadcast): each request's counter base.
        n : int
            Uniforms per request, in [0, 2^34].
        stream : int
            Which of the request's independent streams, in [0, 2^32).

        Returns
        -------
        torch.Tensor
            [B, n] float32 on the device of seed/offset; row b depends only on (seed[b], offset[b], stream).

        Raises
        ------
        ValueError
            n or stream out of range or not an int; seed and offset on different devices, of the wrong kind or of
            different lengths.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> u = ops.philox_uniform(torch.tensor([7, 8]), 0, 4)
        >>> u.shape, u.dtype
        (torch.Size([2, 4]), torch.float32)
        >>> bool(((u > 0) & (u < 1)).all())
        True
        >>> torch.equal(ops.philox_uniform(8, 0, 4)[0], u[1])  # row b depends on its own key only
        True
        """
        return _philox_uniform(self.namespace, seed, offset, n, stream)

    def chain_speculative_sampling(self, draft_token_ids, target_probs, draft_probs=None, *, num_draft_tokens=None,
                                   greedy=None, seed=None, offset=None, generator=None, out=None,
                                   cu_num_draft_tokens=None, max_draft_tokens=None, bonus_token_ids=None, uniforms=None,
                                   final_uniforms=None, draft_to_target=None,
                                   accepted_independently=None, coupling="rejection",
                                   verification="token") -> SamplingOutput:
        """Chain speculative sampling from probabilities: the lossless check of K drafts per request.

        Accepts draft token x at position i with probability min(1, p_i(x) / q_i(x)); at the first rejection draws
        from norm(max(0, p_i - q_i)); if all num_draft_tokens[b] drafts are accepted, draws a bonus token from p_k.
        The emitted tokens are distributed exactly as sampling the target alone (docs/design.md §3.1).

        Parameters
        ----------
        draft_token_ids : torch.Tensor
            [B, K] int32/int64: the drafts ([T] in the flat form).
        target_probs : torch.Tensor
            [B, K+1, V] float32/bfloat16/float16: the target at each draft position and at the bonus position
            ([B, K, V] with bonus_token_ids; flat: [T + B, V], or [T, V] with bonus_token_ids).
        draft_probs : torch.Tensor or None
            [B, K, V] (or [B, K, Vd] with draft_to_target), target_probs' dtype; None: point proposals (q is one-hot
            at the draft token).
        num_draft_tokens : torch.Tensor or int, optional
            [B] (ragged batches) or an int; default K. With cu_num_draft_tokens: a cap, request b judging only its
            first num_draft_tokens[b] (in [0, cu[b] - cu[b-1]]) drafts, its all-accepted token from its target row
            num_draft_tokens[b]; the drafts past the cap are never read (e.g. vLLM's -1 placeholders).
        greedy : torch.Tensor or bool, optional
            [B] bool or a bool: follow the target's argmax; default False.
        seed : torch.Tensor or int, optional
            [B] or an int: each request's Philox key; None draws one from `generator`.
        offset : torch.Tensor or int, optional
            [B] or an int: each request's Philox counter base; default 0.
        generator : torch.Generator, optional
            Draws the seeds when seed is None.
        out : tuple of torch.Tensor, optional
            Preallocated (output_token_ids [B, K+1] int32, num_accepted [B] int32), written and returned.
        cu_num_draft_tokens : torch.Tensor, optional
            [B] int32, the inclusive cumulative sum of the requests' draft counts (vLLM's): the flat form, zero-copy
            (docs/design.md §3.4). draft_token_ids [T], draft rows [T, V], target rows [T + B, V] (request b's k_b
            rows, then its bonus row) or [T, V] with bonus_token_ids; the outputs are exactly the padded form's.
        max_draft_tokens : int, optional
            With cu_num_draft_tokens, a Python int: the outputs are [B, max_draft_tokens + 1] and [B].
        bonus_token_ids : torch.Tensor, optional
            [B] (or [B, 1]) int32/int64: the token emitted when all of request b's drafts are accepted; the bonus row
            is then never read (padded target rows may be [B, K, V]).
        uniforms : torch.Tensor, optional
            [B, K] ([T] flat) float32 in [0, 1): replace the Philox draws of the acceptance tests (accept while
            u * q < p).
        final_uniforms : torch.Tensor, optional
            [B] float32 in [0, 1): replaces the Philox draw of the resampled / bonus token (inverse CDF at u).
        draft_to_target : torch.Tensor, optional
            [Vd] int: draft rows have Vd columns, column j being target id draft_to_target[j] (distinct ids); q is 0
            off the map. Lossless, without expanding the draft rows.
        accepted_independently : torch.Tensor, optional
            [B] int32, filled: the drafts accepted when each is judged on its own (FlashInfer's accepted count); reads
            the rows after the first rejection, which the op otherwise never reads.
        coupling : {"rejection", "gumbel"}
            "rejection": the above. "gumbel" (drafter-invariant): offset[b] is then the absolute position of request
            b's first row, and row i's token is the Gumbel-max sample argmax_v(log p_i(v) + G(v)) with the noise of
            position offset[b] + i (uniform v of Philox stream 2, gumbel_sample's); a draft is accepted when it equals
            that token, and the first one that does not is replaced by it. The emitted tokens are exactly what plain
            sampling with gumbel_sample draws at those positions, whatever the drafts; draft_probs, uniforms and
            final_uniforms must be None. Greedy rows are unchanged.
        verification : {"token", "block"}
            "token": each draft judged on its own, up to the first rejection (the above). "block": block verification
            (Sun et al. 2024, arXiv 2403.10444; vLLM's rejection_sample_method="block"): a sampled request's drafts are
            judged jointly, so that as many are accepted in expectation as any lossless verification reading only the
            rows along the drafts allows (never fewer than "token"); the emitted tokens keep the target's law. It reads
            every target and draft row of the block (docs/ops.md). Greedy requests are judged token by token either way.
            Not with coupling="gumbel" or accepted_independently.

        Returns
        -------
        SamplingOutput
            output_token_ids [B, K+1] int32 (the accepted drafts, the resampled or bonus token, then -1) and
            num_accepted [B] int32 (tokens emitted = num_accepted + 1).

        Raises
        ------
        ValueError
            Invalid input, naming the argument: on the CPU before anything is written; on CUDA an invalid request gets
            defined outputs and set_strict(True) raises. Wrong shapes or types, K above LIMITS["max_draft_tokens"],
            the coupling rules and the verification rules raise on every backend.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> target = torch.tensor([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]])  # [B=1, K+1=3, V=3]
        >>> drafts = torch.tensor([[1, 2]])                                                   # [B, K]
        >>> out = ops.chain_speculative_sampling(drafts, target, greedy=True)  # 1 is the argmax, 2 is not
        >>> out.output_token_ids, out.num_accepted
        (tensor([[ 1,  0, -1]], dtype=torch.int32), tensor([1], dtype=torch.int32))
        >>> out = ops.chain_speculative_sampling(drafts, target, seed=0, uniforms=torch.zeros(1, 2),
        ...                                      final_uniforms=torch.zeros(1))  # u = 0: every draft with p > 0 kept
        >>> out.output_token_ids.tolist(), out.num_accepted.tolist()
        ([[1, 2, 0]], [2])
        >>> draft = torch.tensor([[[0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]])  # q(1) > p(1) at position 0: u = 0.9 rejects it
        >>> u = torch.tensor([[0.9, 0.0]])
        >>> token = ops.chain_speculative_sampling(drafts, target, draft, seed=0, uniforms=u, final_uniforms=u[:, 1])
        >>> block = ops.chain_speculative_sampling(drafts, target, draft, seed=0, uniforms=u, final_uniforms=u[:, 1],
        ...                                        verification="block")  # u_2 = 0 < c_2 = (0.7/0.8)(0.1/0.6)
        >>> token.num_accepted.tolist(), block.num_accepted.tolist()
        ([0], [2])
        """
        return _chain_sampling(self.namespace, draft_token_ids, target_probs, draft_probs, logits=False,
                               num_draft_tokens=num_draft_tokens, greedy_or_temperature=greedy, seed=seed,
                               offset=offset, generator=generator, out=out, cu_num_draft_tokens=cu_num_draft_tokens,
                               max_draft_tokens=max_draft_tokens, bonus_token_ids=bonus_token_ids, uniforms=uniforms,
                               final_uniforms=final_uniforms, draft_to_target=draft_to_target,
                               accepted_independently=accepted_independently, coupling=coupling,
                               records_errors=self.records_errors(target_probs), verification=verification)

    def chain_speculative_sampling_from_logits(self, draft_token_ids, target_logits, draft_logits=None, *, temperature,
                                               num_draft_tokens=None, seed=None, offset=None, generator=None,
                                               out=None, cu_num_draft_tokens=None, max_draft_tokens=None,
                                               bonus_token_ids=None, uniforms=None, final_uniforms=None,
                                               draft_to_target=None, accepted_independently=None,
                                               coupling="rejection", top_k=None, top_p=None,
                                               min_p=None, verification="token", target_lse=None,
                                               draft_lse=None) -> SamplingOutput:
        """Chain speculative sampling from logits: chain_speculative_sampling with p and q computed in the kernel.

        p = softmax(target_logits / temperature[b]) and likewise q are computed inside the kernel in float32 and never
        written to memory; a temperature below 1e-5 (0 included; LIMITS["min_temperature"]) makes a row greedy.

        Parameters
        ----------
        draft_token_ids : torch.Tensor
            [B, K] int32/int64 ([T] flat).
        target_logits : torch.Tensor
            [B, K+1, V] float32/bfloat16/float16: chain_speculative_sampling's target_probs shapes.
        draft_logits : torch.Tensor or None
            [B, K, V] (or [B, K, Vd] with draft_to_target); None: point proposals.
        temperature : float or torch.Tensor
            A float or [B] float32.
        top_k : int or torch.Tensor, optional
            An int or [B] int: keep the k largest logits (ties with the k-th kept); 0: off.
        top_p : float or torch.Tensor, optional
            A float or [B]: then keep the fewest largest whose mass reaches top_p of what top-k kept (ties kept);
            1: off.
        min_p : float or torch.Tensor, optional
            A float or [B]: then keep those with p >= min_p * max p; 0: off.
        target_lse, draft_lse : torch.Tensor, optional
            float32, the rows' shape less V ([B, K+1] and [B, K]; flat: [T+B] and [T]): each row's normaliser
            ln sum exp(logits / temperature) over its processed row, as logits_normalizer computes it (an LM head's
            epilogue or the drafter's sampler may have it). A finite entry replaces that row's statistics pass; a
            non-finite one is ignored. draft_lse is not taken with draft_to_target. See Notes.
        num_draft_tokens, seed, offset, generator, out : optional
            As in chain_speculative_sampling.
        cu_num_draft_tokens, max_draft_tokens, bonus_token_ids : optional
            The engine layouts of chain_speculative_sampling.
        uniforms, final_uniforms, draft_to_target, accepted_independently, coupling, verification : optional
            As in chain_speculative_sampling.

        Returns
        -------
        SamplingOutput
            output_token_ids [B, K+1] int32 and num_accepted [B] int32, as chain_speculative_sampling's.

        Raises
        ------
        ValueError
            chain_speculative_sampling's errors; a Python temperature that is negative or not finite in float32; a
            control out of range (a Python scalar at once, a tensor's entry on the CPU or in strict mode, naming the
            control and the request).

        Notes
        -----
        top_k, top_p and min_p are transformers' logits processing, inside the kernel and without sorting, applied
        after temperature to every target and draft row of a sampled request alike. p and q are the processed
        distributions: a caller that drew its drafts from q processed with the same controls stays lossless. A draft
        row with draft_to_target is processed over its own Vd columns. Definition and method: README "Top-k, top-p,
        min-p"; reference.filter_logits is the readable version.

        With target_lse / draft_lse a probability is exp(logit / temperature - lse) instead of the row's own
        exp((logit - max) / temperature) / sum: every backend and grid still returns the same tokens for the same
        normalisers, and logits_normalizer's own values give the tokens of the call without them except where a
        decision lies within the normaliser's float32 rounding (a relative ~|lse| 2^-24) of its boundary. A normaliser
        off by d scales its row's probabilities by exp(-d). Strict mode (set_strict(True)) computes the rows'
        statistics anyway and raises, naming target_lse or draft_lse, on a value more than 2^-14 + 2^-20 |lse| off.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])  # [B=1, K+1=3, V=3]
        >>> out = ops.chain_speculative_sampling_from_logits(torch.tensor([[1, 0]]), logits, temperature=0.0)
        >>> out.output_token_ids.tolist(), out.num_accepted.tolist()  # greedy: both drafts are the argmax
        ([[1, 0, 2]], [2])
        >>> out = ops.chain_speculative_sampling_from_logits(torch.tensor([[1, 2]]), logits, temperature=1.0,
        ...                                                  top_k=1, seed=3)  # top-k 1 leaves the argmax alone
        >>> out.output_token_ids.tolist()
        [[1, 0, -1]]
        """
        return _chain_sampling(self.namespace, draft_token_ids, target_logits, draft_logits, logits=True,
                               num_draft_tokens=num_draft_tokens, greedy_or_temperature=temperature, seed=seed,
                               offset=offset, generator=generator, out=out, cu_num_draft_tokens=cu_num_draft_tokens,
                               max_draft_tokens=max_draft_tokens, bonus_token_ids=bonus_token_ids, uniforms=uniforms,
                               final_uniforms=final_uniforms, draft_to_target=draft_to_target,
                               accepted_independently=accepted_independently, coupling=coupling,
                               records_errors=self.records_errors(target_logits), top_k=top_k, top_p=top_p,
                               min_p=min_p, verification=verification, target_lse=target_lse, draft_lse=draft_lse)

    def sample_without_drafts(self, logits, *, temperature, seed, offset, coupling="rejection", top_k=None,
                              top_p=None, min_p=None, out=None) -> torch.Tensor:
        """One token per row of logits, drawn by the chain sampling kernel with no drafts: plain sampling.

        The chain op from logits with K = 1 and no draft proposed; the token is its bonus token, from
        softmax(logits / temperature[b]) in float32 processed by top_k, top_p, min_p (argmax below 1e-5), at uniform
        0 of Philox stream 1 of (seed[b], offset[b]). The kernel computes the draft distribution q of the sampling
        ops from the same logits and controls the same way, so a drafter sampling here proposes from exactly the q
        it reports (processed over the same columns in the same order). coupling="gumbel": the Gumbel-max sample with
        the noise of (seed[b], position offset[b]) instead, gumbel_sample's draw, the token the sampling ops'
        gumbel coupling draws at that position. The logits are read in place (a stride-0 view, no copy): with device
        tensors for temperature, seed and offset the call can be captured in a CUDA graph.

        Parameters
        ----------
        logits : torch.Tensor
            [B, V] float32/bfloat16/float16, contiguous in V; unprocessed.
        temperature : float or torch.Tensor
            A float or [B] float32; below 1e-5 (LIMITS["min_temperature"]) is the argmax.
        seed : int or torch.Tensor
            An int or [B] int64: each row's Philox key.
        offset : int or torch.Tensor
            An int or [B] int64: each row's counter base (coupling="gumbel": its absolute position).
        coupling : {"rejection", "gumbel"}
            The inverse-CDF draw at a uniform, or the Gumbel-max sample of the position.
        top_k, top_p, min_p : int, float or torch.Tensor, optional
            The rows processed first, as in chain_speculative_sampling_from_logits (0, 1, 0 or None: off).
        out : torch.Tensor, optional
            A preallocated [B] int32, written and returned.

        Returns
        -------
        torch.Tensor
            [B] int32 (a column of the chain op's output when out is None).

        Raises
        ------
        ValueError
            logits not [B, V], of another dtype, with V outside [1, LIMITS["max_vocab"]] or not contiguous in V; out not
            a [B] int32 tensor on logits' device; the from-logits ops' temperature, control and row errors. Every
            message says sample_without_drafts, logits and offset.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
        >>> ops.sample_without_drafts(logits, temperature=0.0, seed=0, offset=0)  # greedy
        tensor([1, 0], dtype=torch.int32)
        >>> ops.sample_without_drafts(logits, temperature=1.0, seed=0, offset=0, top_k=1)  # top-k 1: the argmax
        tensor([1, 0], dtype=torch.int32)
        >>> drawn = ops.sample_without_drafts(logits, temperature=1.0, seed=7, offset=5, coupling="gumbel")
        >>> torch.equal(drawn, ops.gumbel_sample(logits, temperature=1.0, seed=7, positions=5))
        True
        """
        return _sample_without_drafts(self.namespace, logits, temperature=temperature, seed=seed, offset=offset,
                                      coupling=coupling, top_k=top_k, top_p=top_p, min_p=min_p, out=out,
                                      records_errors=self.records_errors(logits),
                                      names=_MessageNames("sample_without_drafts", "logits"))

    def gumbel_sample(self, logits, *, temperature, seed, positions, out=None, top_k=None, top_p=None,
                      min_p=None) -> torch.Tensor:
        """One token per row of logits: the Gumbel-max sample that the sampling ops' coupling="gumbel" reproduces.

        argmax_v(logits[b, v] / temperature[b] + G(v)), G the noise of (seed[b], positions[b]), which the sampling
        ops' coupling="gumbel" uses for the row at that position. A drafter drawing its drafts here and plain decoding
        drawing here make the speculative output equal to the plain one (docs/design.md §4, sampling="invariant").
        It is sample_without_drafts with coupling="gumbel", in this op's words.

        Parameters
        ----------
        logits : torch.Tensor
            [B, V] float32/bfloat16/float16 (top-k/top-p masks already applied as -inf, or given below).
        temperature : float or torch.Tensor
            A float or [B]; below 1e-5 is the argmax.
        seed : int or torch.Tensor
            An int or [B] int64: each row's Philox key.
        positions : int or torch.Tensor
            An int or [B] int64: each row's absolute position, the counter of its noise.
        out : torch.Tensor, optional
            A preallocated [B] int32, written and returned.
        top_k, top_p, min_p : int, float or torch.Tensor, optional
            The rows processed first, as in chain_speculative_sampling_from_logits.

        Returns
        -------
        torch.Tensor
            [B] int32.

        Raises
        ------
        ValueError
            sample_without_drafts' errors, said in this op's words (gumbel_sample, logits, positions).

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
        >>> ops.gumbel_sample(logits, temperature=0.0, seed=0, positions=0)  # below 1e-5: the argmax
        tensor([1, 0], dtype=torch.int32)
        >>> drawn = ops.gumbel_sample(logits, temperature=1.0, seed=7, positions=torch.tensor([4, 5]))
        >>> torch.equal(drawn, ops.gumbel_sample(logits, temperature=1.0, seed=7, positions=torch.tensor([4, 5])))
        True
        """
        return _sample_without_drafts(self.namespace, logits, temperature=temperature, seed=seed, offset=positions,
                                      coupling="gumbel", top_k=top_k, top_p=top_p, min_p=min_p, out=out,
                                      records_errors=self.records_errors(logits),
                                      names=_MessageNames("gumbel_sample", "logits", offset="positions"))

    def tree_speculative_sampling(self, parents, candidate_token_ids, target_probs, draft_probs=None, *,
                                  num_nodes=None, greedy=None, seed=None, offset=None, generator=None,
                                  out=None, uniforms=None, final_uniforms=None, draft_to_target=None,
                                  cu_num_draft_tokens=None, max_draft_tokens=None,
                                  coupling="rejection") -> TreeSamplingOutput:
        """Tree speculative sampling from probabilities: the lossless check of a tree of candidates.

        Walks a tree of candidates from its root, accepting at each node one child or none, so that every emitted
        token is distributed as the target's (README "Tree speculation"); lossless for point proposals (no
        draft_probs) and for children sampled without replacement from draft_probs.

        Parameters
        ----------
        parents : torch.Tensor
            [B, N] int32 (N <= 64): node c's parent, an earlier node; -1 for the root (node 0, the last emitted token)
            and padding.
        candidate_token_ids : torch.Tensor
            [B, N] int32/int64: each node's token, distinct among siblings.
        target_probs : torch.Tensor
            [B, N, V] float32/bfloat16/float16: the target at every node.
        draft_probs : torch.Tensor or None
            [B, N, V] (or Vd columns with draft_to_target): row n is the draft distribution node n's children were
            drawn from, without replacement and in index order; None: point proposals.
        num_nodes : torch.Tensor or int, optional
            [B] (ragged trees) or an int; default N.
        greedy : torch.Tensor or bool, optional
            [B] bool or a bool: follow the target's argmax.
        seed, offset : torch.Tensor or int, optional
            The RNG contract's key and counter base: node c draws uniform c - 1 of stream 0, the last token uniform 0
            of stream 1. seed None draws from `generator`.
        generator : torch.Generator, optional
            Draws the seeds when seed is None.
        out : tuple of torch.Tensor, optional
            Preallocated (output_token_ids [B, N] int32, accepted_nodes [B, N] int32, num_accepted [B] int32).
        uniforms : torch.Tensor, optional
            [B, N] float32 in [0, 1): node c's acceptance draw in column c (column 0, the root, unused); replaces the
            Philox draws.
        final_uniforms : torch.Tensor, optional
            [B] float32 in [0, 1): the last token's draw.
        draft_to_target : torch.Tensor, optional
            [Vd]: draft rows with a reduced vocabulary (chain_speculative_sampling).
        cu_num_draft_tokens : torch.Tensor, optional
            [B] with max_draft_tokens: flat trees. Request b's k_b + 1 nodes (its root first, parents relative to its
            own nodes) are entries cu[b-1] + b .. cu[b] + b of parents, candidate_token_ids, the target and draft rows
            [T + B, V] and uniforms [T + B]; the outputs are [B, max_draft_tokens + 1], exactly the padded form's.
        max_draft_tokens : int, optional
            With cu_num_draft_tokens, a Python int.
        coupling : {"rejection", "gumbel"}
            "gumbel": node n's row decides with the Gumbel-max token of position offset[b] + depth(n)
            (chain_speculative_sampling): the walk moves to the child carrying it, else emits it.

        Returns
        -------
        TreeSamplingOutput
            output_token_ids [B, N] int32 (the accepted path's tokens, then the resampled or bonus token, -1 padded),
            accepted_nodes [B, N] int32 (the path's nodes from the root, -1 padded: truncate_kv_cache's kept_indices,
            with num_kept = num_accepted + 1) and num_accepted [B] int32.

        Raises
        ------
        ValueError
            A malformed tree (on the CPU; on CUDA such a node is never a child, and strict mode raises), N outside
            [1, 64], candidate_token_ids not of parents' shape, the chain op's row and coupling rules.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> parents = torch.tensor([[-1, 0, 0, 1]])            # the root, its children 1 and 2, node 1's child 3
        >>> tokens = torch.tensor([[5, 1, 2, 3]])              # each node's token (the root's: the last emitted)
        >>> target = torch.tensor([[[0.1, 0.2, 0.6, 0.1], [0.25, 0.25, 0.25, 0.25],
        ...                         [0.1, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.1]]])  # [B=1, N=4, V=4]
        >>> out = ops.tree_speculative_sampling(parents, tokens, target, greedy=True)
        >>> out.output_token_ids.tolist(), out.accepted_nodes.tolist(), out.num_accepted.tolist()
        ([[2, 3, -1, -1]], [[0, 2, -1, -1]], [1])
        """
        return _tree_sampling(self.namespace, parents, candidate_token_ids, target_probs, draft_probs, logits=False,
                              num_nodes=num_nodes, greedy_or_temperature=greedy, seed=seed, offset=offset,
                              generator=generator, out=out, uniforms=uniforms, final_uniforms=final_uniforms,
                              draft_to_target=draft_to_target, cu_num_draft_tokens=cu_num_draft_tokens,
                              max_draft_tokens=max_draft_tokens, coupling=coupling,
                              records_errors=self.records_errors(target_probs))

    def tree_speculative_sampling_from_logits(self, parents, candidate_token_ids, target_logits, draft_logits=None, *,
                                              temperature, num_nodes=None, seed=None, offset=None, generator=None,
                                              out=None, uniforms=None, final_uniforms=None,
                                              draft_to_target=None, cu_num_draft_tokens=None,
                                              max_draft_tokens=None, coupling="rejection", top_k=None, top_p=None,
                                              min_p=None, target_lse=None, draft_lse=None) -> TreeSamplingOutput:
        """Tree speculative sampling from logits: tree_speculative_sampling with p and q computed in the kernel.

        softmax(logits / temperature[b]) in float32 inside the kernel, never written to memory; a temperature below
        1e-5 (LIMITS["min_temperature"]) makes a request greedy.

        Parameters
        ----------
        parents, candidate_token_ids : torch.Tensor
            [B, N], as in tree_speculative_sampling.
        target_logits : torch.Tensor
            [B, N, V] float32/bfloat16/float16.
        draft_logits : torch.Tensor or None
            [B, N, V] (or Vd columns) or None.
        temperature : float or torch.Tensor
            A float or [B] float32.
        top_k, top_p, min_p : int, float or torch.Tensor, optional
            Every node's target and draft rows processed, as in chain_speculative_sampling_from_logits.
        target_lse, draft_lse : torch.Tensor, optional
            [B, N] float32 (flat: [T+B]): the rows' normalisers, as in chain_speculative_sampling_from_logits.
        num_nodes, seed, offset, generator, out, uniforms, final_uniforms : optional
            As in tree_speculative_sampling.
        draft_to_target, cu_num_draft_tokens, max_draft_tokens, coupling : optional
            As in tree_speculative_sampling.

        Returns
        -------
        TreeSamplingOutput
            output_token_ids [B, N], accepted_nodes [B, N], num_accepted [B], as tree_speculative_sampling's.

        Raises
        ------
        ValueError
            tree_speculative_sampling's errors, and the temperature and control errors of
            chain_speculative_sampling_from_logits.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> parents, tokens = torch.tensor([[-1, 0, 0, 1]]), torch.tensor([[5, 1, 2, 3]])
        >>> logits = torch.tensor([[[0.0, 1.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0],
        ...                         [0.0, 0.0, 0.0, 2.0], [2.0, 0.0, 0.0, 0.0]]])  # [B=1, N=4, V=4]
        >>> out = ops.tree_speculative_sampling_from_logits(parents, tokens, logits, temperature=0.0)
        >>> out.output_token_ids.tolist(), out.accepted_nodes.tolist()  # greedy: node 2 (token 2), then 3
        ([[2, 3, -1, -1]], [[0, 2, -1, -1]])
        """
        return _tree_sampling(self.namespace, parents, candidate_token_ids, target_logits, draft_logits, logits=True,
                              num_nodes=num_nodes, greedy_or_temperature=temperature, seed=seed, offset=offset,
                              generator=generator, out=out, uniforms=uniforms, final_uniforms=final_uniforms,
                              draft_to_target=draft_to_target, cu_num_draft_tokens=cu_num_draft_tokens,
                              max_draft_tokens=max_draft_tokens, coupling=coupling,
                              records_errors=self.records_errors(target_logits), top_k=top_k, top_p=top_p,
                              min_p=min_p, target_lse=target_lse, draft_lse=draft_lse)

    def logits_normalizer(self, logits, *, temperature, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
        """Each row's softmax normaliser ln sum exp(logits / temperature), computed as the sampling kernels do.

        The value to pass as target_lse / draft_lse to the from-logits sampling ops: those ops then skip the rows'
        statistics pass. Computed by the sampling kernels' own pass (the canonical order of docs/design.md §3.1), so it
        is the same bits on every backend and grid, over each row processed by top_k / top_p / min_p as those ops
        process it.

        Parameters
        ----------
        logits : torch.Tensor
            [..., V] float32/bfloat16/float16, contiguous in V.
        temperature : float or torch.Tensor
            A float, or float32 of logits' shape less V (a row's request's temperature, repeated over its rows).
        top_k, top_p, min_p : int, float or torch.Tensor, optional
            Per row likewise (shaped like temperature), as in chain_speculative_sampling_from_logits.

        Returns
        -------
        torch.Tensor
            float32 of logits' shape less V: (max * scale + log2 sum) * ln 2 from the row's statistics; -inf for a row
            without mass; +inf for a greedy row (temperature below LIMITS["min_temperature"]), whose normaliser no op
            reads.

        Raises
        ------
        ValueError
            chain_speculative_sampling_from_logits' errors for logits and the controls, in this function's words.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> logits = torch.tensor([[0.0, 1.0, 2.0], [5.0, 5.0, float("-inf")]])
        >>> lse = ops.logits_normalizer(logits, temperature=1.0)
        >>> torch.allclose(lse, torch.logsumexp(logits, -1))
        True
        >>> ops.logits_normalizer(logits, temperature=0.0).tolist()  # greedy rows
        [inf, inf]
        """
        return _logits_normalizer(self.namespace, logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p, records_errors=self.records_errors(logits))

    def truncate_kv_cache(self, cache_seqlens, num_kept, *, block_len=None, kept_indices=None, k_caches=(),
                          v_caches=(), block_table=None, clear=False, kv_layout="NHD", kv_indptr=None,
                          kv_indices=None) -> None:
        """Cuts the KV cache back after verification, in place, without a host sync on CUDA.

        docs/design.md §3.3: the lengths advance by the tokens kept of the verified block; a tree's kept tokens move
        to the front of the block, in every layer in one launch.

        Parameters
        ----------
        cache_seqlens : torch.Tensor
            [B] int32: the lengths before the verified block (as passed to verify); advanced by num_kept, in place.
        num_kept : torch.Tensor or int
            [B] (or an int): tokens of the block that stay (chain: num_accepted + 1). Without kept_indices and clear
            only the lengths change, and num_kept[b] may be any count that keeps cache_seqlens[b] + num_kept[b]
            within the cache (a prefill, a block near the end of the cache).
        block_len : int, optional
            Q, the verified block's length; implied by kept_indices, needed for clear.
        kept_indices : torch.Tensor, optional
            [B, Q] int32, -1 padded: block-relative indices of the kept tokens, increasing (tree): block slot
            kept_indices[b, j] moves to block slot j in every layer.
        k_caches, v_caches : list of torch.Tensor or torch.Tensor
            Every layer's cache, a list or one stacked [L, ...] tensor. Contiguous [B, S_max, Hkv, D] (NHD) or
            [B, Hkv, S_max, D] (HND); paged [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv, page_size, D]
            (HND), any page stride, each page dense (FlashInfer's kv[:, 0], vLLM's kv[0]).
        block_table : torch.Tensor, optional
            [B, max_pages] int32: the pages of a paged cache.
        clear : bool
            Zero the block's discarded slots.
        kv_layout : {"NHD", "HND"}
            The caches' layout.
        kv_indptr, kv_indices : torch.Tensor, optional
            FlashInfer's CSR page table, [B+1] and [nnz] int32: request b's pages are
            kv_indices[kv_indptr[b] : kv_indptr[b+1]]. The lengths stay cache_seqlens; kv_last_page_len is not needed
            (an engine updates its own table after).

        Returns
        -------
        None
            cache_seqlens and the caches are updated in place.

        Raises
        ------
        ValueError
            Invalid requests raise on the CPU before anything is written; on CUDA they are left untouched
            (set_strict(True) raises). A request's pages within the block must be distinct (a page listed twice is an
            invalid request); pages shared across requests are the caller's race.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> cache_seqlens = torch.tensor([5, 3], dtype=torch.int32)
        >>> ops.truncate_kv_cache(cache_seqlens, torch.tensor([2, 1], dtype=torch.int32))  # a chain: lengths only
        >>> cache_seqlens
        tensor([7, 4], dtype=torch.int32)
        >>> k = torch.arange(8.0).reshape(1, 8, 1, 1)  # [B=1, S_max=8, Hkv=1, D=1]; a block of 3 at positions 4..6
        >>> v = k.clone()
        >>> lengths = torch.tensor([4], dtype=torch.int32)
        >>> ops.truncate_kv_cache(lengths, 2, kept_indices=torch.tensor([[0, 2, -1]], dtype=torch.int32),
        ...                       k_caches=[k], v_caches=[v])  # a tree's path: block slots 0 and 2
        >>> lengths, k.flatten().tolist()
        (tensor([6], dtype=torch.int32), [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 6.0, 7.0])
        """
        _truncate_kv_cache(self.namespace, cache_seqlens, num_kept, block_len=block_len, kept_indices=kept_indices,
                           k_caches=k_caches, v_caches=v_caches, block_table=block_table, clear=clear,
                           kv_layout=kv_layout, kv_indptr=kv_indptr, kv_indices=kv_indices,
                           records_errors=self.records_errors(cache_seqlens))

    def verify_attention(self, q, k_cache, v_cache, cache_seqlens=None, k_new=None, v_new=None, *, block_table=None,
                         tree_mask=None, softmax_scale=None, return_lse=False, qo_indptr=None, kv_layout="NHD",
                         kv_indptr=None, kv_indices=None, kv_last_page_len=None, window_left=-1, logits_soft_cap=0.0,
                         out=None):
        """Attention of the verify step: each request's new tokens against its KV cache.

        docs/design.md §3.2, §3.4. Query i of request b sits at position length_b + i; it sees cache[0 : length_b]
        and new token j where tree_mask[i, j] (default causal, j <= i). k_new/v_new, when given, are written into the
        cache at length_b + j first; no length is advanced. Hq % Hkv == 0 (GQA/MQA).

        Parameters
        ----------
        q : torch.Tensor
            Padded [B, Q, Hq, D] (Q = K+1 or a tree's size, 1..128); or flat [T, Hq, D] with qo_indptr.
        k_cache, v_cache : torch.Tensor
            kv_layout "NHD" ([.., S or page_size, Hkv, D]) or "HND" ([.., Hkv, S or page_size, D]); contiguous
            [B, ...] with cache_seqlens, or paged [num_pages, ...] (any page stride, each page dense: FlashInfer's
            kv[:, 0] / kv[:, 1], vLLM's kv[0] / kv[1], zero-copy) through block_table or the CSR table.
        cache_seqlens : torch.Tensor, optional
            [B] int32: length_b. Must be None with the CSR table.
        k_new, v_new : torch.Tensor, optional
            [B, Q, Hkv, D] (flat: [T, Hkv, D]): the new tokens' keys and values, appended first.
        block_table : torch.Tensor, optional
            [B, max_pages] int32: the pages of a paged cache, with cache_seqlens.
        tree_mask : torch.Tensor, optional
            bool [Q, Q] or [B, Q, Q] (True: query i sees new token j); flat: request b's [Q_b, Q_b] row-major at
            offset sum_{c<b} Q_c^2.
        softmax_scale : float, optional
            A finite number > 0; None: 1/sqrt(D).
        return_lse : bool
            Also return the log-sum-exp of each query's scores.
        qo_indptr : torch.Tensor, optional
            [B+1] int32 (FlashInfer / vLLM): request b owns rows qo_indptr[b] .. qo_indptr[b+1] of the flat q
            (0..128 of them). The flat form returns bit for bit what per-request padded calls return.
        kv_layout : {"NHD", "HND"}
            The caches' layout.
        kv_indptr, kv_indices, kv_last_page_len : torch.Tensor, optional
            FlashInfer's CSR table [B+1], [nnz], [B] int32: request b's pages are kv_indices[kv_indptr[b] :
            kv_indptr[b+1]], each last page holding 1..page_size tokens. As in FlashInfer, the table describes the KV
            after this step's tokens were appended: kv_len_b = (pages_b - 1) * page_size + kv_last_page_len[b]
            includes the Q_b new tokens, and length_b = kv_len_b - Q_b (k_new, when given, is written into those last
            Q_b slots).
        window_left : int
            -1 (off) or w >= 0: a query at position p sees only keys at positions >= p - w (FlashInfer's).
        logits_soft_cap : float
            0 (off) or c > 0: each scaled score s becomes c * tanh(s / c) (Gemma 2, FlashInfer's).
        out : torch.Tensor, optional
            Preallocated output (q's shape and dtype, contiguous; CUDA graphs), written in place and returned.

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            out (q's shape and dtype), or (out, lse) with return_lse: lse float32 of q's shape without D.

        Raises
        ------
        ValueError
            CPU: float32, bfloat16, float16, any head dim up to 256; invalid input raises. CUDA: float16 and bfloat16
            on tensor cores (sm_80+), head dim 16, 32, 64, 128 or 256, no host sync; a request whose block runs past its
            cache, whose pages are outside the cache or whose qo_indptr / kv_indptr entries are inconsistent gets NaN
            outputs (rows unknown with a bad qo_indptr: nothing written); set_strict(True) raises. Rows of q that no
            request owns (qo_indptr[B] < T) are not written. A page that k_new is written to must appear once among
            the pages its request touches: the CPU refuses a repeat, CUDA in strict mode (elsewhere the appends and
            reads race); across requests the caller owns the race.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> g = torch.Generator().manual_seed(0)
        >>> k_cache, v_cache = torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4)  # [B=1, S_max=8, Hkv=1, D=4]
        >>> v_cache[:, :3] = 1.0                                                    # 3 tokens cached, values 1
        >>> q = torch.randn(1, 2, 2, 4, generator=g)                                # [B, Q=2, Hq=2, D]
        >>> k_new, v_new = torch.randn(1, 2, 1, 4, generator=g), torch.ones(1, 2, 1, 4)
        >>> out, lse = ops.verify_attention(q, k_cache, v_cache, torch.tensor([3], dtype=torch.int32), k_new, v_new,
        ...                                 return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 2, 2, 4]), torch.Size([1, 2, 2]))
        >>> torch.allclose(out, torch.ones_like(out)), torch.equal(k_cache[0, 3:5], k_new[0])  # k_new appended
        (True, True)
        """
        return _verify_attention(self.namespace, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                 block_table=block_table, tree_mask=tree_mask, softmax_scale=softmax_scale,
                                 return_lse=return_lse, qo_indptr=qo_indptr, kv_layout=kv_layout, kv_indptr=kv_indptr,
                                 kv_indices=kv_indices, kv_last_page_len=kv_last_page_len, window_left=window_left,
                                 logits_soft_cap=logits_soft_cap, out=out, records_errors=self.records_errors(q))

    def quantized_linear(self, x, qweight, format: int, bias=None, *, activations: str = "float") -> torch.Tensor:
        """x @ W^T (+ bias) with the weight W [N, K] kept as GGUF blocks.

        Any number of rows, accumulated in float32 with the weights decoded in registers or cache, never in memory.
        activations="int8" first quantises each row of x per 32 values, as llama.cpp's CPU path does: d = max |x| /
        127, q = round-half-even(x / d); the CPU then multiplies on integer dot products (VNNI or AVX2), about 2x
        faster at one row and 2.5-3x at 16, and every output row has the same bits whatever the number of rows in
        the call and on every ISA (CUDA multiplies the same quantised values as floats).

        Parameters
        ----------
        x : torch.Tensor
            [..., K] float32, bfloat16 or float16.
        qweight : torch.Tensor
            [N, row_bytes] uint8: W's rows as blocks of `format`.
        format : int
            A GGML type id of QUANTIZED_FORMATS: Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q6_K 14.
        bias : torch.Tensor, optional
            [N].
        activations : str
            "float" (default): x as given; "int8": x quantised to 8 bits per 32 values (docs/ops.md bounds the
            difference).

        Returns
        -------
        torch.Tensor
            [..., N] in x's dtype.

        Raises
        ------
        ValueError
            format not one of the five; qweight not a uint8 [N, row_bytes] with row_bytes a non-zero multiple of the
            format's block; x's last dim not K; a device mismatch; a bias not [N]; activations not "float" or "int8".

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> scale = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # a Q8_0 block: an fp16 scale,
        >>> quants = torch.arange(32, dtype=torch.int8).view(torch.uint8)       # then 32 int8 weights
        >>> qweight = torch.cat([scale, quants]).repeat(2, 1)                    # [N=2, row_bytes=34]: K = 32
        >>> ops.quantized_linear(torch.ones(1, 32), qweight, 8)                  # 0 + 1 + ... + 31
        tensor([[496., 496.]])
        >>> ops.quantized_linear(torch.ones(1, 32), qweight, 8, activations="int8")  # ones are exact in 8 bits
        tensor([[496., 496.]])
        """
        return _quantized_linear(self.namespace, x, qweight, format, bias, activations)

    def dequantize(self, qweight, format: int) -> torch.Tensor:
        """GGUF blocks to float32 rows: the weights quantized_linear multiplies with.

        Equal to the gguf package's dequantize bit for bit (embedding lookups of a quantised table).

        Parameters
        ----------
        qweight : torch.Tensor
            [N, row_bytes] uint8 GGUF blocks.
        format : int
            A GGML type id of QUANTIZED_FORMATS: Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q6_K 14.

        Returns
        -------
        torch.Tensor
            [N, K] float32.

        Raises
        ------
        ValueError
            As quantized_linear's for format and qweight.

        Examples
        --------
        >>> import torch
        >>> from specdec_ext import ops
        >>> scale = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)  # a Q8_0 block: scale 0.5
        >>> qweight = torch.cat([scale, torch.arange(32, dtype=torch.int8).view(torch.uint8)]).unsqueeze(0)
        >>> ops.dequantize(qweight, 8)[:, :4]
        tensor([[0.0000, 0.5000, 1.0000, 1.5000]])
        """
        return _dequantize(self.namespace, qweight, format)


NATIVE = Ops(torch.ops.specdec, records_errors=_on_device)
philox_uniform = NATIVE.philox_uniform
chain_speculative_sampling = NATIVE.chain_speculative_sampling
chain_speculative_sampling_from_logits = NATIVE.chain_speculative_sampling_from_logits
tree_speculative_sampling = NATIVE.tree_speculative_sampling
sample_without_drafts = NATIVE.sample_without_drafts
gumbel_sample = NATIVE.gumbel_sample
logits_normalizer = NATIVE.logits_normalizer
tree_speculative_sampling_from_logits = NATIVE.tree_speculative_sampling_from_logits
truncate_kv_cache = NATIVE.truncate_kv_cache
verify_attention = NATIVE.verify_attention
quantized_linear = NATIVE.quantized_linear
dequantize = NATIVE.dequantize


def skinny_linear(x, weight, bias=None) -> torch.Tensor:
    """x @ weight^T (+ bias) for at most 16 rows of x: the GEMM of decode and verify steps.

    On the CPU a kernel that reads the weight once with every core (MKL's sgemv uses one), chosen by instruction set
    (cpu_isa()); on CUDA at::linear. Accumulated in float32.

    Parameters
    ----------
    x : torch.Tensor
        [..., K] float32 or bfloat16, at most 16 rows in all (LIMITS["max_skinny_rows"]).
    weight : torch.Tensor
        [N, K] contiguous, x's dtype.
    bias : torch.Tensor, optional
        [N], x's dtype.

    Returns
    -------
    torch.Tensor
        [..., N] in x's dtype.

    Raises
    ------
    ValueError
        More than 16 rows (use F.linear) or a device mismatch; on the CPU, weight not a contiguous [N, K] with x's K,
        dtypes that differ, a bias not [N] of x's dtype.

    Examples
    --------
    >>> import torch
    >>> from specdec_ext import ops
    >>> ops.skinny_linear(torch.ones(2, 4), torch.ones(3, 4), torch.tensor([0.0, 1.0, 2.0]))
    tensor([[4., 5., 6.],
            [4., 5., 6.]])
    """
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > LIMITS["max_skinny_rows"]:
        raise ValueError(f"skinny_linear: at most {LIMITS['max_skinny_rows']} rows, got {rows.shape[0]} (use F.linear)")
    _check_devices("skinny_linear", x.device, "x", weight=weight, bias=bias)
    return torch.ops.specdec.skinny_linear(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


@_fake("skinny_linear")
def _skinny_linear_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def cpu_isa() -> str:
    """The instruction set the CPU GEMM kernels (skinny_linear, quantized_linear) use now: avx512, avx2 or sse2;
    the best the CPU has, or the environment variable SPECDEC_CPU_ISA when set (read on every call)."""
    return _C.cpu_isa()


# A Llama decoder layer's elementwise steps, one CPU call each (csrc/cpu/model_glue.cpp): each computes what torch's
# expression computes, in the same dtype steps. CPU only, float32 or bfloat16; specdec_ext.models.llama calls them on
# the CPU and torch's expressions elsewhere.

def rms_norm(x, weight, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it, in one CPU call.

    weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype): torch's result but for the order of the
    mean's sum.

    Parameters
    ----------
    x : torch.Tensor
        [..., H] contiguous, float32 or bfloat16 (H > 0).
    weight : torch.Tensor
        [H] contiguous, x's dtype.
    eps : float
        Added to the mean square.

    Returns
    -------
    torch.Tensor
        x's shape and dtype.

    Raises
    ------
    ValueError
        x not a contiguous [..., H] with H > 0; weight not a contiguous [H] of x's dtype; another dtype.

    Examples
    --------
    >>> import torch
    >>> from specdec_ext import ops
    >>> ops.rms_norm(torch.full((1, 4), 2.0), torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.0)  # x / rms(x) = 1
    tensor([[1., 2., 3., 4.]])
    """
    return torch.ops.specdec.rms_norm(x, weight, eps)


@_fake("rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


def add_rms_norm(x, delta, weight, eps: float) -> torch.Tensor:
    """The residual add in place, then RMSNorm, in one CPU call.

    x += delta (in x's dtype), then rms_norm(x, weight, eps).

    Parameters
    ----------
    x : torch.Tensor
        [..., H] contiguous, float32 or bfloat16: the residual stream, updated in place.
    delta : torch.Tensor
        x's shape and dtype, contiguous.
    weight : torch.Tensor
        [H], x's dtype.
    eps : float
        Added to the mean square.

    Returns
    -------
    torch.Tensor
        rms_norm(x + delta); x then holds x + delta.

    Raises
    ------
    ValueError
        delta not of x's shape and dtype or not contiguous, and rms_norm's errors.

    Examples
    --------
    >>> import torch
    >>> from specdec_ext import ops
    >>> x = torch.ones(1, 4)
    >>> ops.add_rms_norm(x, torch.ones(1, 4), torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.0)
    tensor([[1., 2., 3., 4.]])
    >>> x
    tensor([[2., 2., 2., 2.]])
    """
    return torch.ops.specdec.add_rms_norm(x, delta, weight, eps)


@_fake("add_rms_norm")
def _add_rms_norm_fake(x, delta, weight, eps):
    return torch.empty_like(x)


def rotary_split(qkv, cos, sin, num_q_heads: int, num_kv_heads: int) -> tuple:
    """Splits a fused qkv projection into q, k, v and applies RoPE to q and k, in one CPU call.

    q and k rotated as x cos + cat(-x2, x1) sin, each product and the sum rounded to the dtype: transformers'
    apply_rotary_pos_emb bit for bit (halves, not interleaved).

    Parameters
    ----------
    qkv : torch.Tensor
        [B, Q, (num_q_heads + 2 num_kv_heads) D] contiguous, float32 or bfloat16.
    cos, sin : torch.Tensor
        [B, Q, 1, D] contiguous, qkv's dtype: the angles of each position.
    num_q_heads, num_kv_heads : int
        Hq and Hkv, both > 0.

    Returns
    -------
    tuple of torch.Tensor
        q [B, Q, num_q_heads, D], k [B, Q, num_kv_heads, D], v [B, Q, num_kv_heads, D], contiguous.

    Raises
    ------
    ValueError
        qkv not contiguous 3-D with a width divisible by num_q_heads + 2 num_kv_heads; an odd head dim; cos / sin not
        contiguous [B, Q, 1, D] of qkv's dtype.

    Examples
    --------
    >>> import torch
    >>> from specdec_ext import ops
    >>> qkv = torch.arange(16.0).reshape(1, 1, 16)  # Hq = 2, Hkv = 1, D = 4
    >>> q, k, v = ops.rotary_split(qkv, torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), 2, 1)  # angle 0
    >>> q.shape, k.shape, v.flatten().tolist()
    (torch.Size([1, 1, 2, 4]), torch.Size([1, 1, 1, 4]), [12.0, 13.0, 14.0, 15.0])
    """
    return torch.ops.specdec.rotary_split(qkv, cos, sin, num_q_heads, num_kv_heads)


@_fake("rotary_split")
def _rotary_split_fake(qkv, cos, sin, num_q_heads, num_kv_heads):
    b, q, width = qkv.shape
    d = width // (num_q_heads + 2 * num_kv_heads)
    return (qkv.new_empty((b, q, num_q_heads, d)), qkv.new_empty((b, q, num_kv_heads, d)),
            qkv.new_empty((b, q, num_kv_heads, d)))


def silu_mul(gate_up) -> torch.Tensor:
    """silu(gate) * up of a fused gate_up projection, in one CPU call.

    ATen's vectorised silu (the exp F.silu uses), rounded to the dtype, then the product: torch's two ops bit for
    bit.

    Parameters
    ----------
    gate_up : torch.Tensor
        [..., 2 I] float32 or bfloat16: gate and up, the two halves of the last dim.

    Returns
    -------
    torch.Tensor
        [..., I], gate_up's dtype.

    Raises
    ------
    ValueError
        An odd last dim; a dtype other than float32 and bfloat16.

    Examples
    --------
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from specdec_ext import ops
    >>> gate_up = torch.tensor([[-1.0, 0.0, 1.0, 2.0, 3.0, 4.0]])  # gate [-1, 0, 1], up [2, 3, 4]
    >>> ops.silu_mul(gate_up).shape, torch.equal(ops.silu_mul(gate_up), F.silu(gate_up[:, :3]) * gate_up[:, 3:])
    (torch.Size([1, 3]), True)
    """
    return torch.ops.specdec.silu_mul(gate_up)


@_fake("silu_mul")
def _silu_mul_fake(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _register_fakes(namespace: str) -> None:
    """Registers every schema's fake kernel (the `_<op>_fake` functions beside the ops) for `namespace`."""
    for op, fake in _FAKES.items():
        torch.library.register_fake(f"{namespace}::{op}")(fake)


_register_fakes("specdec")

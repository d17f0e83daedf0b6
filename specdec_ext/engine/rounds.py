"""One round of speculative decoding, for every running request at once (ragged: each at its own length and k):

  1. the drafter proposes up to k tokens per request (ChainRound) or a tree of candidates (TreeRound);
  2. the Verifier scores the request's last emitted token plus its drafts in one target forward (a tree under
     its mask), the sampling op accepts a prefix (a path) and draws the next token (greedy and sampled requests
     in one launch, temperature inside the kernel, top-k/top-p masks applied to target and draft logits alike),
     and truncate_kv_cache keeps the accepted tokens in the target's cache (a tree's path moved to the front);
  3. one host read of the VerifyResult; the drafter rolls back to what was accepted (its RoundFeedback).
Plain decoding is a ChainRound without a drafter (k = 0: the verify block is the last token alone).

Invariant: the target's cache holds every token of a request but the last emitted one, which opens the next
verify block. Request r's round draws from Philox key seed[r] at offset = tokens r has generated, so its output
depends on its own prompt, parameters and seed only. Under Gumbel coupling (sampling="invariant") the token at
each position is the Gumbel-max sample with that position's noise, whoever drafted: the output is plain
decoding's, whatever the drafter, k, tree or batch.
"""
import functools
import time
from dataclasses import dataclass

import torch

from ..drafters.base import RoundFeedback, RoundInputs
from ..host import read, upload
from ..logits_processing import process_block
from ..ops import chain_speculative_sampling_from_logits, sample_without_drafts, tree_speculative_sampling_from_logits
from .controls import CallControls, SlotControls, emitted_logprobs


class Stopwatch:
    """A round's seconds by phase: each lap(phase) adds the time since the previous mark to that phase."""

    def __init__(self):
        self.mark = time.perf_counter()
        self.seconds = {"draft": 0.0, "verify": 0.0, "sample": 0.0}

    def lap(self, phase: str, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.seconds[phase] += now - self.mark
        self.mark = now


@dataclass
class VerifyResult:
    """What the verify step decided for each row of a round, as host lists. On the device it is one int32 row per
    request, so that the round reads it back once: [tokens (W) | num_accepted | trees only: path (W) | num_nodes |
    depth | with block_argmax: argmax (W)], W the block width (a chain: its drafts + 1, at least 2)."""
    tokens: list        # [batch] lists: the accepted drafts, then the recovered or bonus token
    num_accepted: list  # [batch] ints: drafts accepted (a tree: the accepted path's depth)
    num_draft: list | None = None     # trees: [batch] nodes below the root (chains: the round's own counts)
    paths: list | None = None         # trees: [batch] lists, the accepted nodes below the root (node = rank + 1)
    depths: list | None = None        # trees: [batch] the tree's depth
    block_argmax: list | None = None  # trees with block_argmax: [batch] lists, the target's greedy token per node
    logprobs: list | None = None      # with logprobs: [batch] lists of TokenLogprobs, one per token of `tokens`

    @staticmethod
    def pack(tokens, num_accepted, path=None, num_nodes=None, depths=None, argmax=None) -> torch.Tensor:
        """tokens [B, W] int32, num_accepted [B] int32; trees: path [B, W] int32, num_nodes [B], depths [B, W],
        argmax [B, W] or None -> [B, 2W + 3 (+ W)] int32 (a chain: [B, W + 1])."""
        columns = [tokens, num_accepted.unsqueeze(1)]
        if path is not None:
            columns += [path, num_nodes.unsqueeze(1).int(), depths.amax(1, keepdim=True).int()]
            if argmax is not None:
                columns.append(argmax.int())
        return torch.cat(columns, 1)

    @classmethod
    def unpack(cls, rows: list, tree_width: int | None = None) -> "VerifyResult":
        """pack's rows read back ([B] lists); tree_width: W of a tree round, None for a chain."""
        if tree_width is None:
            return cls([row[:row[-1] + 1] for row in rows], [row[-1] for row in rows])
        n = tree_width
        accepted = [row[n] for row in rows]
        return cls([row[:a + 1] for row, a in zip(rows, accepted)], accepted, [row[2 * n + 1] - 1 for row in rows],
                   [row[n + 2:n + 2 + a] for row, a in zip(rows, accepted)], [row[2 * n + 2] for row in rows],
                   [row[2 * n + 3:] for row in rows] if len(rows[0]) > 2 * n + 3 else None)


class SlotParams:
    """Per-slot sampling parameters on the device, written at admission (temperature, top_k, top_p, seed, and the
    generation controls) and every round (steps: tokens generated, the Philox counter), which CUDA graphs replay on."""

    def __init__(self, slots: int, device, coupling: str = "rejection", vocab_size: int = 0):
        self.coupling = coupling
        self.controls = SlotControls(slots, vocab_size, device)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(slots, dtype=torch.int64, device=device)
        self.steps = torch.zeros(slots, dtype=torch.int64, device=device)

    def set(self, b: int, r) -> None:
        # fill_ takes the number as a kernel argument; `tensor[b] = number` would copy it from pageable host memory,
        # which synchronises with the device.
        for column, value in ((self.temperature, r.temperature), (self.top_k, r.top_k), (self.top_p, r.top_p),
                              (self.seed, r.seed)):
            column[b].fill_(value)
        self.controls.admit(b, r)

    def round_inputs(self, slots: list, batch: int, ks: list) -> RoundInputs:
        """The round's view for a drafter; uploads the steps (no host synchronisation)."""
        running = slots[:batch]
        self.steps[:batch].copy_(upload([len(r.generated) if r is not None else 0 for r in running], torch.int64,
                                        self.steps.device), non_blocking=True)
        call = self.controls.call
        return RoundInputs(batch, ks, [r.tokens if r is not None else None for r in running],
                           self.temperature[:batch], self.top_k[:batch], self.top_p[:batch], self.seed[:batch],
                           self.steps[:batch], self.coupling, self.controls.min_p[:batch] if call.min_p else None,
                           self.controls.block(batch, self.steps[:batch]) if call.on else None, self.controls.epoch)


@dataclass(frozen=True)
class StepShape:
    """What a verify step's work depends on beyond its input tensors: one CUDA graph per shape."""
    tree: bool
    batch: int
    width: int            # the block: the last token and its drafts (a tree: its nodes)
    coupling: str
    draft_rows: bool      # draft logits are read (not under gumbel coupling, not for point drafts)
    hidden_states: bool | tuple  # the target's hidden states go back to the drafter (a tuple: of those layers)
    block_argmax: bool    # the target's greedy token at every node goes back to the drafter (trees)
    controls: CallControls = CallControls()  # the generation controls the call turns on


class Verifier:
    """The target's verify step for chains and trees: one forward over [last token, drafts] (a tree: [root, nodes]
    under its mask), the sampling op, and the truncation that keeps num_accepted + 1 tokens of the block (a tree's
    path moved to its front). Every row is processed with its request's top-k and top-p inside the sampling op."""

    def __init__(self, target, graphs, verification: str = "token"):
        self.target, self.graphs, self.verification = target, graphs, verification  # chains: the ops' verification
        self.forward_end = None  # when the last eager step's forward ended (None under a graph replay)

    def bind(self, cache, params: SlotParams) -> None:
        self.cache, self.params = cache, params

    def __call__(self, r: RoundInputs, ids, live, draft_logits, *, num_draft=None, tree=None,
                 hidden_states: bool | tuple = False, draft_to_target=None, block_argmax: bool = False):
        """ids [batch, W] int64; live [batch] int32 (0: an idle row, which keeps nothing); a chain: num_draft [batch]
        int32 (W - 1 the widest), draft_logits [batch, W - 1, V or Vd] unprocessed (draft_to_target [Vd] int32 with a
        draft vocabulary); a tree: the DraftTree (ids its token_ids, draft_logits its own). Returns (the packed
        VerifyResult [batch, *] int32 on the device, the target's hidden states [batch, W, H] of the block (a tree:
        of the accepted path, in path order) or None)."""
        if r.coupling == "gumbel":  # each row decides by its own Gumbel-max token: the draft rows are not read
            draft_logits = draft_to_target = None
        shape = StepShape(tree is not None, *ids.shape, r.coupling, draft_logits is not None, hidden_states,
                          block_argmax, self.params.controls.call)
        inputs = (ids, live, draft_logits, num_draft) + ((None,) * 4 if tree is None else
                                                         (tree.parents, tree.tree_mask, tree.num_nodes, tree.depths))
        self.forward_end = None
        step = functools.partial(self.step, shape, r, draft_to_target)
        packed, hidden, self.drawn_from = self.graphs.run(shape, step, inputs, state=[self.cache.cache_seqlens])
        return packed, hidden

    def emitted_logprobs(self, r: RoundInputs, verified: VerifyResult, live: list) -> list | None:
        """After the round's read, with logprobs: each row's emitted tokens' TokenLogprobs, from the block rows they
        were drawn from (a chain: row i drew token i; a tree: the path's node i), only those (the rows past a
        rejection are never normalised)."""
        controls = self.params.controls.call
        if controls.logprobs is None:
            return None
        paths = verified.paths
        where = [(b, i if paths is None else ([0] + paths[b])[i], t) for b, tokens in enumerate(verified.tokens)
                 if live[b] for i, t in enumerate(tokens)]
        b, i, tokens = upload(where, torch.int64, self.drawn_from.device).view(-1, 3).unbind(1)
        rows = self.drawn_from[b, i]                                                  # [M, V]
        flat = emitted_logprobs(rows, tokens, controls.logprobs, temperature=r.temperature[b],
                                top_k=r.top_k[b], top_p=r.top_p[b], min_p=r.min_p[b] if r.min_p is not None else None,
                                processed=controls.logprobs_mode == "processed")
        out, start = [], 0
        for tokens, alive in zip(verified.tokens, live):
            out.append(flat[start:start + len(tokens)] if alive else None)
            start += len(tokens) if alive else 0
        return out

    def step(self, shape: StepShape, r: RoundInputs, draft_to_target, ids, live, draft_logits, num_draft, parents,
             tree_mask, num_nodes, depths):
        """The verify step on device tensors alone (no host synchronisation: a CUDA graph captures it)."""
        cache, rows = self.cache, slice(0, r.batch)
        logits = self.target(ids, cache, tree_mask=tree_mask, cache_rows=rows, output_hidden_states=shape.hidden_states)
        logits, hidden = logits if shape.hidden_states is not False else (logits, None)  # [batch, W, V], [batch, W, H*]
        self.forward_end = time.perf_counter()
        controls = shape.controls
        raw = logits.clone() if controls.logprobs is not None and controls.logprobs_mode == "raw" else None
        if r.controls is not None:  # each row with the history it has in plain decoding (drafts on its path)
            process_block(logits, ids, r.controls, ancestors=tree_mask, parents=parents, depths=depths)
        sampling = dict(temperature=r.temperature, seed=r.seed, offset=r.steps, coupling=r.coupling, top_k=r.top_k,
                        top_p=r.top_p, min_p=r.min_p)
        drawn_from = (raw if raw is not None else logits) if controls.logprobs is not None else None  # logprobs
        if not shape.tree:
            if shape.width == 1:  # no drafts: the next token drawn from the last token's logits
                tokens = sample_without_drafts(logits[:, 0], **sampling).unsqueeze(1)
                num_accepted = torch.zeros_like(live)
            else:
                out = chain_speculative_sampling_from_logits(ids[:, 1:].contiguous(), logits, draft_logits,
                                                             num_draft_tokens=num_draft,
                                                             draft_to_target=draft_to_target,
                                                             verification=self.verification, **sampling)
                tokens, num_accepted = out.output_token_ids, out.num_accepted
            cache.truncate((num_accepted + 1) * live, rows, free_pages=False)
            return VerifyResult.pack(tokens, num_accepted), hidden, drawn_from
        out = tree_speculative_sampling_from_logits(parents, ids, logits, draft_logits, num_nodes=num_nodes,
                                                    **sampling)
        cache.truncate((out.num_accepted + 1) * live, rows, kept_indices=out.accepted_nodes, free_pages=False)
        if hidden is not None:  # the path's features in path order: a chain of num_accepted drafts to the drafter
            path = out.accepted_nodes.long().clamp_min(0)
            hidden = hidden.gather(1, path.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        argmax = logits.argmax(-1) if shape.block_argmax else None
        return VerifyResult.pack(out.output_token_ids, out.num_accepted, out.accepted_nodes, num_nodes, depths,
                                 argmax), hidden, drawn_from


@dataclass
class RoundResult:
    """What a round did, per row of its batch."""
    verified: VerifyResult
    num_draft: list       # drafts verified (a tree: its nodes below the root)
    seconds: dict         # {"draft", "verify", "sample"}: the Stopwatch's phases


class ChainRound:
    """Each request drafts up to its k tokens in a chain; drafter None: plain decoding (k = 0)."""

    def __init__(self, drafter, verifier: Verifier):
        self.drafter, self.verifier = drafter, verifier

    def run(self, r: RoundInputs, live: list, budget: int = 0) -> RoundResult:
        clock = Stopwatch()
        drafter, device = self.drafter, self.verifier.target.device
        proposal = drafter.propose(r) if drafter is not None and max(r.num_tokens) else None
        ks = proposal.num_draft_tokens if proposal is not None else [0] * r.batch
        width = max(ks)
        if not width:  # no request could draft (e.g. a head before its first feature): a plain round
            proposal = None
        clock.lap("draft")
        ids = upload([[h[-1] if h is not None else 0] for h in r.histories], torch.int64, device)  # [batch, 1]
        if width:
            ids = torch.cat([ids, proposal.draft_token_ids[:, :width]], 1)  # [batch, width + 1]
        self.verifier.cache.reserve([width + 1] * r.batch, requests=list(range(r.batch)))
        packed, hidden = self.verifier(r, ids, upload(live, torch.int32, device),
                                       proposal.draft_logits if proposal is not None else None,
                                       num_draft=upload(ks, torch.int32, device),
                                       hidden_states=drafter is not None and drafter.target_features,
                                       draft_to_target=proposal.draft_to_target if proposal is not None else None)
        verified = VerifyResult.unpack(read(packed))
        return finish_round(clock, self.verifier, drafter, verified, live, hidden, ks, r)


class TreeRound:
    """Each request drafts a tree of at most `budget` nodes (the root included) and depth k."""

    def __init__(self, drafter, verifier: Verifier, branching: int):
        self.drafter, self.verifier, self.branching = drafter, verifier, branching

    def run(self, r: RoundInputs, live: list, budget: int = 0) -> RoundResult:
        if not max(r.num_tokens):  # no request may draft (at its end): a plain round
            return ChainRound(self.drafter, self.verifier).run(r, live)
        clock = Stopwatch()
        tree = self.drafter.propose_tree(r, budget, self.branching)
        clock.lap("draft")
        width = tree.parents.shape[1]
        # Compaction touches the whole block of every row of the cache, idle ones too: each needs its pages.
        self.verifier.cache.reserve(width)
        packed, hidden = self.verifier(r, tree.token_ids, upload(live, torch.int32, self.verifier.target.device),
                                       tree.draft_logits, tree=tree, hidden_states=self.drafter.target_features,
                                       block_argmax=self.drafter.needs_block_argmax)
        verified = VerifyResult.unpack(read(packed), tree_width=width)
        return finish_round(clock, self.verifier, self.drafter, verified, live, hidden, verified.num_draft, r)


def finish_round(clock: Stopwatch, verifier: Verifier, drafter, verified: VerifyResult, live: list, hidden,
                 num_draft: list, r: RoundInputs) -> RoundResult:
    """After the round's one host read: the logprobs of the emitted tokens (a second read, with logprobs only), the
    phases timed, the drafter rolled back to what was accepted."""
    verified.logprobs = verifier.emitted_logprobs(r, verified, live)
    read_end = time.perf_counter()
    clock.lap("verify", verifier.forward_end or read_end)  # a graph replay: the whole step counts as verify
    clock.lap("sample", read_end)
    if drafter is not None:
        drafter.rollback(RoundFeedback([a if alive else -1 for a, alive in zip(verified.num_accepted, live)], hidden,
                                       verified.paths, verified.block_argmax))
        clock.lap("draft")
    return RoundResult(verified, num_draft, clock.seconds)

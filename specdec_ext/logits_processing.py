"""Generation controls on a verify block's logits: bad words, min_tokens, logit bias and the repetition, frequency
and presence penalties, each row processed with the history it has in plain decoding.

Row i of a block predicts the token after history(i): the request's tokens (prompt and generated, the last emitted
one included) and then the drafts on the path to i (a chain: drafts 1..i; a tree: node i's ancestors below the root
and node i). `ancestors[b, i, j]` marks those drafts (column 0, the last emitted token, is already in the history).
Everything here is tensor arithmetic with no host synchronisation, so a CUDA graph captures it with the verify step.

The order is vLLM's: bans (bad words, min_tokens: -inf), then the logit bias, then the penalties:
  repetition (transformers' RepetitionPenaltyLogitsProcessor, vLLM's): a token of the prompt or of the output has its
      logit divided by the penalty when positive, multiplied when negative;
  frequency and presence (OpenAI's, vLLM's): minus frequency * count - presence * (count > 0), counting output
      tokens only.
Temperature, top-k, top-p and min-p come after, inside the sampling kernels.

The penalties touch only the tokens a row has seen: every token of the history (prompt and output) and of the block
is gathered from every row, recomputed from the count that row sees (the count before the block plus the drafts on
its path that are that token) and scattered back: [B, W, L + W] work, not [B, W, V]. A token listed twice gets the
same value twice, and a padding entry (any token) gets that token's own correct value, so padding needs no mask.
Every value comes from `penalty_factors` and `penalized`, so a token gets bit for bit the value plain decoding gives
it at that history.
"""
from typing import NamedTuple

import torch

NEG_INF = float("-inf")


class DraftColumns(NamedTuple):
    """Logits over a draft vocabulary of Vd target ids, [.., Vd + 1] with a trash column Vd: ids [Vd] int64 (the target
    id of each column) and of_token [V] int64 (each target id's column, Vd outside the draft vocabulary)."""
    ids: torch.Tensor
    of_token: torch.Tensor

    @classmethod
    def of(cls, draft_vocab: torch.Tensor, vocab_size: int) -> "DraftColumns":
        ids = draft_vocab.long()
        of_token = torch.full((vocab_size,), len(ids), dtype=torch.int64, device=ids.device)
        return cls(ids, of_token.scatter_(0, ids, torch.arange(len(ids), device=ids.device)))


def chain_ancestors(batch: int, width: int, device) -> torch.Tensor:
    """The ancestors of a chain block [last token, drafts 1..W-1]: row i sees drafts 1..i -> [batch, W, W] bool."""
    rows = torch.arange(width, device=device)
    mask = (rows.unsqueeze(1) >= rows) & (rows > 0)  # [W, W]: j <= i, j >= 1
    return mask.expand(batch, width, width)


def chain_parents(batch: int, width: int, device) -> torch.Tensor:
    """A chain block as a tree: node j's parent is j - 1 -> [batch, W] int64 (the root -1)."""
    return (torch.arange(width, device=device) - 1).expand(batch, width)


def penalty_factors(count: torch.Tensor, in_prompt: torch.Tensor, repetition: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(divisor, offset) of the penalties of tokens with output `count` (int) and `in_prompt` (bool): a logit x
    becomes (x / divisor if x > 0 else x * divisor) + offset. The per-request values broadcast against count."""
    seen = count > 0
    divisor = torch.where(seen | in_prompt, repetition, 1.0)
    offset = -(frequency * count + presence * seen)
    return divisor, offset


def penalized(x: torch.Tensor, divisor: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x / divisor, x * divisor) + offset


def apply_penalties(logits: torch.Tensor, block_ids: torch.Tensor, ancestors: torch.Tensor, history: torch.Tensor,
                    output_counts: torch.Tensor, prompt_mask: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    columns: DraftColumns | None = None) -> torch.Tensor:
    """logits [B, R, V] float32 (in place): rows of a block block_ids [B, W] int64 (column 0 already counted in the
    history); ancestors [B, R, W] bool: the drafts each row has seen; history [B, L] int64: every token of the prompt
    and the output before the block (any padding token); output_counts [B, V] int32 (the output tokens before the
    block), prompt_mask [B, V] bool, repetition / presence / frequency [B] float32 -> logits, each row penalised with
    its own history. columns: see process_block."""
    b, rows, _ = logits.shape
    per_request = [t.view(b, 1, 1) for t in (repetition, presence, frequency)]
    seen = torch.cat([history, block_ids], 1)                             # [B, T]: every token a row may have seen
    at = seen if columns is None else columns.of_token[seen]              # their logits columns
    index = at.unsqueeze(1).expand(b, rows, seen.shape[1])                # [B, R, T]
    before = logits.gather(2, index)
    # Row i's count of token t: before the block, plus the drafts among its ancestors that are t.
    same = (block_ids.unsqueeze(2) == seen.unsqueeze(1)).float()          # [B, W, T]
    extra = torch.bmm(ancestors.float(), same).round().int()               # [B, R, T]
    count = output_counts.gather(1, seen).unsqueeze(1) + extra            # [B, R, T]
    in_prompt = prompt_mask.gather(1, seen).unsqueeze(1).expand_as(index)
    divisor, offset = penalty_factors(count, in_prompt, *per_request)
    return logits.scatter_(2, index, penalized(before, divisor, offset))


def block_contexts(tail: torch.Tensor, block_ids: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """The last C tokens of each row's history -> [B, W, C] int64 (-1 before the start).

    tail [B, C] int64: the last C tokens before the block, right-aligned, the last emitted token (block column 0)
    last; -1 pads a shorter history. parents [B, W]: each node's parent in the block (a chain: j - 1; the root -1)."""
    b, c = tail.shape
    w = block_ids.shape[1]
    if c == 0:
        return tail.new_zeros(b, w, 0)
    # One walk over [sentinel, tail without its last token, the block]: the root's parent is the tail's last entry
    # but one, a tail entry's parent the one before it, and the sentinel (index 0, token -1) its own parent.
    tokens = torch.cat([tail.new_full((b, 1), -1), tail[:, :-1], block_ids], 1)         # [B, C + W]
    base = torch.arange(c, device=tail.device).expand(b, c) - 1                           # sentinel and tail
    block_parent = torch.where(parents >= 0, parents.long() + c, c - 1)                   # block nodes
    parent = torch.cat([base.clamp_min(0), block_parent], 1)                              # [B, C + W]
    node = torch.arange(w, device=tail.device).expand(b, w) + c
    context = []
    for _ in range(c):
        context.append(tokens.gather(1, node))
        node = parent.gather(1, node)
    return torch.stack(context[::-1], 2)


def apply_bad_words(logits: torch.Tensor, contexts: torch.Tensor, prefixes: torch.Tensor,
                    last_tokens: torch.Tensor, columns: DraftColumns | None = None) -> torch.Tensor:
    """Bans (-inf) a bad word's last token in the rows whose history ends with its other tokens.

    logits [B, W, V] (in place); contexts [B, W, C] (block_contexts); prefixes [B, N, C] int64: bad word n's tokens
    but its last, right-aligned, -2 (any token) to the left; last_tokens [B, N] int64: its last token, -1 for an
    unused entry. columns: see process_block."""
    b, w, _ = logits.shape
    n = last_tokens.shape[1]
    match = ((contexts.unsqueeze(2) == prefixes.unsqueeze(1)) | (prefixes.unsqueeze(1) == -2)).all(-1)  # [B, W, N]
    match &= (last_tokens >= 0).unsqueeze(1)
    value = torch.where(match, NEG_INF, float("inf")).to(logits.dtype)
    at = last_tokens.clamp_min(0) if columns is None else columns.of_token[last_tokens.clamp_min(0)]
    return logits.scatter_reduce_(2, at.unsqueeze(1).expand(b, w, n), value, "amin")


def apply_min_tokens(logits: torch.Tensor, generated: torch.Tensor, depths: torch.Tensor, min_tokens: torch.Tensor,
                     stop_ids: torch.Tensor, columns: DraftColumns | None = None) -> torch.Tensor:
    """Bans the stop tokens (EOS) in rows that predict output token generated + depth < min_tokens.

    logits [B, W, V] (in place); generated [B] int64 (tokens output before the block); depths [B, W] (a chain:
    0..W-1); min_tokens [B] int64; stop_ids [E] int64. columns: see process_block."""
    b, w, _ = logits.shape
    early = (generated.unsqueeze(1) + depths) < min_tokens.unsqueeze(1)                # [B, W]
    value = torch.where(early, NEG_INF, float("inf")).to(logits.dtype).unsqueeze(2).expand(b, w, stop_ids.numel())
    at = stop_ids if columns is None else columns.of_token[stop_ids]
    return logits.scatter_reduce_(2, at.view(1, 1, -1).expand(b, w, -1), value, "amin")


class BlockControls(NamedTuple):
    """The device tensors of a round's controls, rows [0, B) of the slots; None: that control is off for the call.
    V is the target's vocabulary."""
    output_counts: torch.Tensor | None = None  # [B, V] int32, with prompt_mask [B, V] bool, history [B, L] int64
    prompt_mask: torch.Tensor | None = None    # (apply_penalties) and [B] float32 repetition / presence / frequency
    history: torch.Tensor | None = None        # (1, 0, 0: off)
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None     # [B, V] float32
    tail: torch.Tensor | None = None           # [B, C] int64 with bad words (block_contexts)
    bad_word_prefixes: torch.Tensor | None = None  # [B, N, C] int64, with bad_word_last [B, N] (apply_bad_words)
    bad_word_last: torch.Tensor | None = None
    generated: torch.Tensor | None = None      # [B] int64 with min_tokens [B] int64 and stop_ids [E] int64
    min_tokens: torch.Tensor | None = None
    stop_ids: torch.Tensor | None = None


def process_block(logits: torch.Tensor, block_ids: torch.Tensor, controls: BlockControls, *,
                  ancestors: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                  depths: torch.Tensor | None = None, columns: DraftColumns | None = None) -> torch.Tensor:
    """Every control of `controls` on a block's logits [B, W, V] float32 (in place), block_ids [B, W] int64. A
    chain block by default; a tree: its ancestors [B, W, W] bool (ancestor-or-self, as DraftTree.tree_mask),
    parents [B, W] and depths [B, W]. Logits [B, 1, V] with a chain of W > 1 are the row of its last node alone (a
    drafter's next draft after the drafts so far). columns: logits over a draft vocabulary, [B, W, Vd + 1] (the last
    a trash column the caller drops). Returns logits.

    Example
    -------
    >>> import torch
    >>> from specdec_ext.logits_processing import BlockControls, process_block
    >>> logits = torch.tensor([[[1.0, 2.0, -1.0], [1.0, 2.0, -1.0]]])  # [B=1, W=2 (last token, one draft), V=3]
    >>> controls = BlockControls(output_counts=torch.tensor([[0, 0, 0]], dtype=torch.int32),
    ...                          prompt_mask=torch.tensor([[False, False, False]]), history=torch.tensor([[0]]),
    ...                          repetition=torch.tensor([2.0]), presence=torch.tensor([0.0]),
    ...                          frequency=torch.tensor([0.0]))
    >>> process_block(logits, torch.tensor([[0, 1]]), controls)  # row 1 has seen the draft, token 1
    tensor([[[ 1.,  2., -1.],
             [ 1.,  1., -1.]]])
    """
    b, w = block_ids.shape
    device = logits.device
    last_only = logits.shape[1] == 1 and w > 1
    if ancestors is None:
        ancestors = chain_ancestors(b, w, device)
    else:  # drop the root column: the last emitted token is already in the history
        ancestors = ancestors & (torch.arange(w, device=device) > 0)
    if last_only:
        ancestors = ancestors[:, -1:]
    if controls.bad_word_last is not None:
        if parents is None:
            parents = chain_parents(b, w, device)
        contexts = block_contexts(controls.tail, block_ids, parents)
        apply_bad_words(logits, contexts[:, -1:] if last_only else contexts, controls.bad_word_prefixes,
                        controls.bad_word_last, columns)
    if controls.min_tokens is not None:
        if depths is None:
            depths = torch.arange(w, device=device).expand(b, w)
        apply_min_tokens(logits, controls.generated, depths[:, -1:] if last_only else depths, controls.min_tokens,
                         controls.stop_ids, columns)
    if controls.logit_bias is not None:
        if columns is None:
            logits += controls.logit_bias.unsqueeze(1)
        else:
            logits[..., :-1] += controls.logit_bias.index_select(1, columns.ids).unsqueeze(1)
    if controls.output_counts is not None:
        apply_penalties(logits, block_ids, ancestors, controls.history, controls.output_counts, controls.prompt_mask,
                        controls.repetition, controls.presence, controls.frequency, columns)
    return logits

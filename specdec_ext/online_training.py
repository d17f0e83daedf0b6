"""Continual draft training: an EAGLE head or Medusa heads keep learning from what the decoder serves.

The drafter hands over, every round, pairs (the target's feature of token j, token j + 1) of every request: an EAGLE
head is fed exactly those (EagleDrafter.feed_pending), Medusa heads read the features the target's verify returned
and pair them with the tokens emitted after them (MedusaDrafter.pair). OnlineDraftTraining keeps the recent pairs in
a bounded replay buffer (whole requests' streams, the oldest dropped first) and, every `every` rounds, takes `steps`
AdamW steps on windows drawn from it, with offline training's loss: EAGLE's training-time test (training.ttt_forward,
training.eagle3_loss), Medusa's cross-entropy of head i against token j + 2 + i (training.medusa_loss), labelled by
the tokens the target emitted (its greedy or sampled choice). The target's output does not change: only what the
heads draft, and so the acceptance, does. The time it takes is capped at a share of the run's wall time.
"""
import time

import torch

from .training import eagle3_loss, eagle_parameters, medusa_loss


class OnlineDraftTraining:
    """Give it to SpeculativeDecoder(..., online_draft_training=OnlineDraftTraining()) with an EagleDrafter whose
    head runs in floating point (not on a kept target's integer kernels: their weights are a quantised copy), or a
    MedusaDrafter (whose trained weights are float on any target: only the LM head's rows it shares are kept blocks).

    Parameters
    ----------
    every : int
        Rounds between updates.
    steps : int
        AdamW steps per update.
    lr : float
        Learning rate (no schedule: serving has no end).
    windows, window : int
        Windows of `window` consecutive pairs per step, drawn uniformly from the buffer.
    buffer_tokens : int
        The most pairs kept (memory: buffer_tokens x the feature width x the target's dtype).
    unroll : int
        Steps of EAGLE's training-time test (offline training's default: 3).
    max_time_share : float
        Updates are skipped while their seconds exceed this share of the run's.
    seed : int
        Of the windows drawn.
    """

    def __init__(self, every: int = 8, steps: int = 1, lr: float = 5e-4, windows: int = 4, window: int = 32,
                 buffer_tokens: int = 16384, unroll: int = 3, max_time_share: float = 0.1, seed: int = 0):
        for name, value, low in (("every", every, 1), ("steps", steps, 1), ("windows", windows, 1),
                                 ("window", window, 2), ("buffer_tokens", buffer_tokens, 2), ("unroll", unroll, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"OnlineDraftTraining: {name} must be an int >= {low}, got {value!r}")
        if not (isinstance(lr, float) and lr > 0) or not 0 < max_time_share <= 1:
            raise ValueError(f"OnlineDraftTraining: lr must be a float > 0 and max_time_share in (0, 1], got "
                             f"{lr!r}, {max_time_share!r}")
        self.every, self.steps, self.lr, self.windows, self.window = every, steps, lr, windows, window
        self.buffer_tokens, self.unroll, self.max_time_share = buffer_tokens, unroll, max_time_share
        self.generator = torch.Generator().manual_seed(seed)
        self.head = None
        self.streams = {}     # slot -> [features [n, F], tokens [n] int64]: the pairs of the request it serves
        self.finished = []    # earlier requests' [features, tokens], oldest first
        self.rounds = self.updates = 0
        self.train_s = self.run_s = 0.0
        self.losses = []

    def bind(self, drafter) -> None:
        """Attaches to an EagleDrafter or a MedusaDrafter: its pairs come here, its head(s) are trained."""
        from .drafters.eagle import EagleDrafter
        from .drafters.medusa import MedusaDrafter

        if not isinstance(drafter, (EagleDrafter, MedusaDrafter)):
            raise ValueError(f"online_draft_training trains an EAGLE head or Medusa heads: the drafter must be an "
                             f"EagleDrafter or a MedusaDrafter, got {type(drafter).__name__}")
        head = drafter.head if isinstance(drafter, EagleDrafter) else drafter.heads
        if isinstance(drafter, EagleDrafter) and head.on_integer_kernels:
            raise ValueError("online_draft_training: the head runs on the integer kernels (a kept int8 target); "
                             "train it on a floating-point target")
        if self.head is not head:
            self.head, self.eagle = head, isinstance(drafter, EagleDrafter)
            self.params = eagle_parameters(head) if self.eagle else list(head.trained_state().values())
            self.optimiser = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=0.0)
            vocab = head.target_config.vocab_size
            self.remap = torch.full((vocab,), -1, dtype=torch.int64, device=head.draft_vocab.device)
            self.remap[head.draft_vocab] = torch.arange(len(head.draft_vocab), device=head.draft_vocab.device)
        drafter.observer = self

    # ------------------------------------------------------------------------------------------------ the pairs
    def pairs(self, slot: int, features: torch.Tensor, tokens: list) -> None:
        """The head was fed pairs (features [n, F] of tokens j, tokens j + 1) for the request in `slot`."""
        if not tokens:
            return
        ids = torch.tensor(tokens, dtype=torch.int64)
        stream = self.streams.get(slot)
        if stream is None:
            self.streams[slot] = [features.detach().clone(), ids]
        else:
            stream[0], stream[1] = torch.cat([stream[0], features.detach()]), torch.cat([stream[1], ids])
        self.trim()

    def release(self, slot: int) -> None:
        stream = self.streams.pop(slot, None)
        if stream is not None:
            self.finished.append(stream)

    def held(self) -> int:
        return sum(len(s[1]) for s in list(self.streams.values()) + self.finished)

    def trim(self) -> None:
        """Drops the oldest finished requests, then the oldest pairs of the longest running one, to the budget."""
        while self.held() > self.buffer_tokens:
            if self.finished:
                self.finished.pop(0)
                continue
            slot = max(self.streams, key=lambda b: len(self.streams[b][1]))
            drop = self.held() - self.buffer_tokens
            self.streams[slot] = [t[drop:] for t in self.streams[slot]]

    # ---------------------------------------------------------------------------------------------- the updates
    def after_round(self, seconds: float) -> None:
        """A round took `seconds`: every `every` rounds, an update (unless over the time share)."""
        self.rounds += 1
        self.run_s += seconds
        if self.rounds % self.every or self.train_s > self.max_time_share * self.run_s:
            return
        t0 = time.perf_counter()
        for _ in range(self.steps):
            batch = self.sample()
            if batch is None:
                break
            self.losses.append(self.step(*batch))
            self.updates += 1
        self.train_s += time.perf_counter() - t0

    def sample(self):
        """`windows` windows of window + 1 consecutive pairs (the last one's token labels the window's last row),
        as ttt_forward's (tokens [B, W + 1], features [B, W + 1, F]) and eagle3_loss's hard labels. medusa_loss
        reads the same tensors: token column c >= 1 is feature row c's own token, so row j's label for head i,
        column j + 2 + i, is the token two or more after it (column 0 and the zero feature row are never read)."""
        streams = [s for s in list(self.streams.values()) + self.finished if len(s[1]) > self.window]
        if not streams:
            return None
        sizes = torch.tensor([len(s[1]) - self.window for s in streams], dtype=torch.float64)
        picks = torch.multinomial(sizes, self.windows, replacement=True, generator=self.generator).tolist()
        starts = [int(torch.randint(0, int(sizes[i]), (1,), generator=self.generator)) for i in picks]
        feats = torch.stack([streams[i][0][s:s + self.window] for i, s in zip(picks, starts)])       # [B, W, F]
        nxt = torch.stack([streams[i][1][s:s + self.window + 1] for i, s in zip(picks, starts)])     # [B, W + 1]
        device = self.head.draft_vocab.device
        b = len(picks)
        # ttt_forward's tokens: column 0 unused, then pair j's token x_{s+j+1}; features: pair j's feature, a zero
        # row last. Row p's label (eagle3_loss reads it at column p + 1): the token after x_{s+p+1}, pair p + 1's.
        tokens = torch.cat([torch.zeros(b, 1, dtype=torch.int64), nxt[:, :-1]], 1).to(device)
        features = torch.cat([feats, torch.zeros_like(feats[:, :1])], 1).to(device)
        top_ids = nxt.unsqueeze(-1).to(device)                                                   # [B, W + 1, 1]
        valid = torch.ones(b, self.window + 1, dtype=torch.bool, device=device)
        return tokens, features, valid, top_ids, torch.ones_like(top_ids, dtype=torch.float32)

    def step(self, tokens, features, valid, top_ids, top_probs) -> float:
        """One AdamW step of the head's loss (EAGLE: the training-time test's; Medusa: medusa_loss, whose labels are
        the tokens themselves); returns the loss."""
        with torch.enable_grad():
            for p in self.params:
                p.requires_grad_(True)
            features = features.to(self.params[0].dtype)
            if self.eagle:
                loss, _ = eagle3_loss(self.head, tokens, features, valid, top_ids, top_probs, self.remap, self.unroll)
            else:
                loss = medusa_loss(self.head, tokens, features, valid, self.remap)
            self.optimiser.zero_grad(set_to_none=True)
            loss.backward()
            self.optimiser.step()
            for p in self.params:
                p.requires_grad_(False)
        return float(loss.detach())

    @property
    def time_share(self) -> float:
        return self.train_s / self.run_s if self.run_s else 0.0

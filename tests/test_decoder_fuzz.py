"""A fuzz test of the decoder: random prompt lengths (1 up to near the length limit), batch sizes, drafters, chains
and trees, paged and static caches, k, temperatures, EOS ids and max_seq_len. Every greedy request must equal plain
greedy decoding token for token, and every request's finish reason must be the one its tokens show.

SPECDEC_FUZZ_CASES cases (default 400: about 40 s on 2 idle cores), seed SPECDEC_FUZZ_SEED (default 0): the same
cases on every run and every machine. (A time budget ran fewer cases on a busy machine: which cases a run checked
depended on its load.)"""
import os
import random

import pytest

from helpers.models import VOCAB, make_drafter, random_vocab, tiny_model
from specdec_ext import ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext.engine import generate_autoregressive

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
CASES = int(os.environ.get("SPECDEC_FUZZ_CASES", "400"))
SEED = int(os.environ.get("SPECDEC_FUZZ_SEED", "0"))


def random_case(rng: random.Random) -> dict:
    drafter = rng.choice(["ngram", "model", "eagle", "medusa"])
    tree = rng.choice([None, None, rng.choice([4, 8, 16])]) if drafter != "model" else None
    max_seq_len = rng.choice([None, rng.randint(8, 64)])
    limit = max_seq_len or 256
    n = rng.randint(1, 6)
    lengths = [rng.choice([1, 2, rng.randint(1, limit - 1)]) for _ in range(n)]
    phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]
    prompts = [(phrase * L)[:L] if rng.random() < 0.5 else [rng.randrange(VOCAB) for _ in range(L)] for L in lengths]
    return dict(drafter=drafter, tree=tree, max_seq_len=max_seq_len, prompts=prompts,
                max_new=[rng.randint(1, 24) for _ in range(n)], k=rng.randint(1, 6),
                adaptive=rng.choice([True, False, "heuristic"]), paged=rng.random() < 0.5,
                max_batch_size=rng.randint(1, 4), eos=rng.choice([None, rng.randrange(VOCAB)]),
                temperature=[rng.choice([0.0, 0.0, 0.8]) for _ in range(n)], seed=rng.randrange(2**31))


def test_fuzz_greedy_equals_plain_and_finish_reasons_hold():
    target = tiny_model(seed=1234)
    draft = tiny_model(seed=77, layers=1, hidden=32, heads=2, kv_heads=1)
    vocab = random_vocab(VOCAB, 64, 1)
    rng = random.Random(SEED)
    for cases in range(1, CASES + 1):
        c = random_case(rng)
        drafter = NgramDrafter() if c["drafter"] == "ngram" else ModelDrafter(draft) if c["drafter"] == "model" \
            else make_drafter(c["drafter"], target, vocab, seed=c["seed"])
        dec = SpeculativeDecoder(target, drafter, c["k"], adaptive=c["adaptive"], max_batch_size=c["max_batch_size"],
                                 max_seq_len=c["max_seq_len"], paged=c["paged"], tree=c["tree"])
        out = dec.generate(c["prompts"], c["max_new"], temperature=c["temperature"], seed=c["seed"],
                           eos_token_id=c["eos"])
        plain = generate_autoregressive(target, c["prompts"], c["max_new"], eos_token_id=c["eos"],
                                        max_seq_len=c["max_seq_len"])
        limit = c["max_seq_len"] or target.config.max_position_embeddings
        for r, (p, s, why) in enumerate(zip(c["prompts"], out.sequences, out.finish_reasons)):
            where = f"case {cases} {c}, request {r}"
            if c["temperature"][r] == 0:
                assert s == plain.sequences[r], where
            assert len(s) >= 1 and len(p) + len(s) <= limit and len(s) <= c["max_new"][r], where
            assert c["eos"] is None or c["eos"] not in s[:-1], where
            if why == "eos":
                assert s[-1] == c["eos"], where
            elif why == "length":
                assert len(s) == c["max_new"][r], where
            else:
                assert why == ("max_seq_len" if c["max_seq_len"] else "context") and len(p) + len(s) == limit, where
    print(f"{CASES} fuzz cases (seed {SEED})")

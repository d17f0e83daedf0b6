"""sampling="invariant": sampled speculative output equals plain sampling with the same seeds token for token, for every
drafter, chains and trees, fixed and adaptive k, alone and in mixed batches, static and paged caches; on tiny random
models and on the shipped model. Fixed seeds throughout."""
import pytest

from helpers.models import make_drafter, random_prompts, random_vocab, shipped_model, tiny_model
from specdec_ext import ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext.engine import CostModel, generate_autoregressive
from specdec_ext.factory import make_drafter as make_shipped_drafter
from specdec_ext.factory import prompt_ids
from specdec_ext.models import default_model_path
from specdec_ext.training import load_prompts

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# A 16-token vocabulary with spread-out distributions: drafts are often right and sampled tokens vary.
VOCAB = 16
TREE = dict(num_nodes=16, depth=4, branching=3)
# Five ragged requests through three slots, mixed parameters: sampled at several temperatures, top-k, top-p, one greedy.
PROMPTS = random_prompts(3, [6, 1, 14, 3, 9], vocab=VOCAB)
MAX_NEW = [20, 14, 9, 24, 17]
PARAMS = dict(temperature=[0.8, 1.0, 0.0, 0.8, 1.3], top_k=[0, 5, 0, 0, 0], top_p=[0.9, 1.0, 1.0, 0.9, 1.0],
              seed=[10, 20, 30, 40, 50])
COSTS = CostModel({1: 1.0, 64: 1.4}, {1: 0.1})  # adaptive k without a measurement: the same k on every machine


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=1234, logit_scale=0.3)


@pytest.fixture(scope="module")
def plain(target):
    """Plain invariant sampling of each request alone (one slot)."""
    return SpeculativeDecoder(target, None, max_batch_size=1, sampling="invariant").generate_autoregressive(
        PROMPTS, MAX_NEW, **PARAMS).sequences


def drafter_of(name, target):
    if name == "ngram":
        return NgramDrafter(3, 1)
    if name == "model":
        return ModelDrafter(tiny_model(vocab=VOCAB, seed=77, layers=1, hidden=32, heads=2, kv_heads=1, logit_scale=0.3))
    return make_drafter(name, target, random_vocab(VOCAB, 12, 1), seed=1)


CASES = [(d, shape) for d in ("ngram", "model", "eagle", "medusa") for shape in ("k=3", "adaptive")] + \
        [(d, "tree") for d in ("ngram", "eagle", "eagle3", "medusa")]


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("name,shape", CASES, ids=[f"{d}-{s}" for d, s in CASES])
def test_speculative_output_is_plain_sampling(target, plain, name, shape, paged):
    dec = SpeculativeDecoder(target, drafter_of(name, target), 3, adaptive=shape == "adaptive", costs=COSTS,
                             max_batch_size=3, paged=paged, tree=TREE if shape == "tree" else None,
                             sampling="invariant")
    out = dec.generate(PROMPTS, MAX_NEW, **PARAMS)
    assert out.sequences == plain
    # Speculation happened and paid: sampled drafts were accepted, so a round emitted several tokens.
    assert out.stats.num_accepted_tokens > 0 and out.stats.mean_acceptance_length > 1.1, out.stats
    # The same request alone, at another slot and batch: the same tokens.
    alone = dec.generate([PROMPTS[3]], MAX_NEW[3], **{key: [v[3]] for key, v in PARAMS.items()})
    assert alone.sequences[0] == plain[3]


def test_plain_decoders_agree_whatever_the_batch(target, plain):
    batched = generate_autoregressive(target, PROMPTS, MAX_NEW, sampling="invariant", **PARAMS).sequences
    assert batched == plain
    # Rejection mode's plain decoding draws by inverse CDF: other tokens (same law), so invariance is not vacuous.
    assert generate_autoregressive(target, PROMPTS, MAX_NEW, **PARAMS).sequences != plain


def test_rejection_mode_depends_on_k(target):
    # What invariant mode removes: under rejection sampling, another k gives other sampled tokens.
    runs = [SpeculativeDecoder(target, drafter_of("model", target), k, adaptive=False, max_batch_size=3,
                               sampling=sampling).generate(PROMPTS, MAX_NEW, **PARAMS).sequences
            for sampling in ("rejection", "invariant") for k in (2, 4)]
    assert runs[0] != runs[1] and runs[2] == runs[3]


def test_bad_sampling_mode_names_itself(target):
    with pytest.raises(ValueError, match="sampling must be one of"):
        SpeculativeDecoder(target, None, sampling="gumbel")
    with pytest.raises(ValueError, match="sampling must be one of"):
        generate_autoregressive(target, PROMPTS[:1], 4, sampling="Invariant")


def test_shipped_model_eagle_equals_plain_sampling():
    # SmolLM2-135M-Instruct with its shipped EAGLE head, chains of adaptive k and trees, T = 0.8, top-p 0.9.
    target, tokenizer = shipped_model()
    prompts = [prompt_ids(tokenizer, r["prompt"]) for r in load_prompts("heldout")][:2]
    params = dict(temperature=0.8, top_p=0.9, seed=[5, 6], eos_token_id=tokenizer.eos_token_id)
    plain = SpeculativeDecoder(target, None, max_batch_size=2, sampling="invariant").generate_autoregressive(
        prompts, 24, **params)
    drafter = make_shipped_drafter("eagle", target, default_model_path())
    for tree in (None, dict(num_nodes=16, depth=5, branching=4)):
        out = SpeculativeDecoder(target, drafter, 4, max_batch_size=2, tree=tree, costs=COSTS,
                                 sampling="invariant").generate(prompts, 24, **params)
        assert out.sequences == plain.sequences
        assert out.stats.mean_acceptance_length > 1.2, out.stats

"""The draft heads' training data (specdec_ext/draft_data.py): the held-out prompts share no word 8-gram with any
prompt the recipe can make (every template x topic, every question instruction x topic, the shipped training
prompts it keeps), the guard finds a planted one whatever its case and punctuation, the prompt draw is fixed by its
seed, target-written questions are cleaned as documented, and the file round-trips and refuses a wrong one."""
import pytest
import torch

from specdec_ext.draft_data import (
    DraftData,
    check_heldout,
    clean_question,
    heldout_chat_prompts,
    heldout_ngrams,
    heldout_prompts,
    prompt_seeds,
    question_requests,
    stdlib_docstrings,
    template_prompts,
    word_ngrams,
)
from specdec_ext.training import load_prompts


def test_no_prompt_the_recipe_can_make_shares_an_8gram_with_a_heldout_prompt():
    seeds, grams = prompt_seeds(), heldout_ngrams()
    assert len(grams) > 500 and len(heldout_chat_prompts()) >= 50
    made = [t.replace("{topic}", topic) for templates in seeds["templates"].values() for t in templates
            for topic in seeds["topics"]]
    made += [q.replace("{topic}", topic) for q in seeds["question_seeds"] for topic in seeds["topics"]]
    assert len(made) > 200_000
    assert not [p for p in made if word_ngrams(p) & grams]
    # The shipped training prompts that do share one (the old split's summaries reuse a held-out instruction) are
    # exactly those the guard drops.
    shared = check_heldout([r["prompt"] for r in load_prompts("train")])
    assert shared and all(word_ngrams(load_prompts("train")[i]["prompt"]) & grams for i in shared)


def test_the_guard_finds_a_planted_heldout_8gram():
    prompt = heldout_chat_prompts()[7]["prompt"]
    words = prompt.split()
    planted = "Some answer text. " + " ".join(words[2:10]).upper().replace(" ", " -- ") + " and more."
    seven = "Some answer text. " + " ".join(words[2:9]) + " and more."
    assert check_heldout(["unrelated text about compilers and parsers", planted, seven]) == [1]
    assert len(heldout_prompts()) == len(heldout_chat_prompts()) + len(load_prompts("heldout"))


def test_prompt_draw_is_fixed_by_its_seed():
    a, b, c = template_prompts(50, 0), template_prompts(50, 0), template_prompts(50, 1)
    assert a == b and a != c and len({r["prompt"] for r in a}) == 50
    assert {r["category"] for r in a} == set(prompt_seeds()["templates"])
    assert all("{topic}" not in r["prompt"] for r in a)
    assert question_requests(20, 0) == question_requests(20, 0) != question_requests(20, 3)


@pytest.mark.parametrize("text,question", [
    ('Sure! How about: "Can you tell me how to set up a satellite internet service?" Hope it helps.',
     "Can you tell me how to set up a satellite internet service?"),
    ("Question: How do tides work in the open ocean?\nThey are caused by the moon.",
     "How do tides work in the open ocean?"),
    ("Why is eating raw food a good idea for backpacking?", "Why is eating raw food a good idea for backpacking?"),
    ("What a wonderful question!\nA beginner wants help with optics.", None),  # under 6 words
    ("The 2023 election saw a breakdown of parties.", None),  # no question
])
def test_target_questions_are_cleaned(text, question):
    assert clean_question(text) == question


def test_stdlib_docstrings_are_read_without_importing():
    docs = stdlib_docstrings()
    assert len(docs) > 1000 and all(len(d.split()) >= 12 for d in docs)
    assert any("Return" in d for d in docs)


def test_file_round_trip_and_errors(tmp_path):
    data = DraftData(tokens=torch.arange(10, dtype=torch.int32), offsets=torch.tensor([0, 4, 10]),
                     answer_start=torch.tensor([2, 0], dtype=torch.int32),
                     source=torch.tensor([1, 3], dtype=torch.int8),
                     split=torch.tensor([1, 0], dtype=torch.int8), greedy=torch.tensor([True, False]),
                     recipe={"seed": 3})
    data.save(tmp_path / "d.safetensors")
    back = DraftData.load(tmp_path / "d.safetensors")
    assert back.recipe == {"seed": 3} and back.sequence(1).tolist() == list(range(4, 10))
    assert back.indices("validation") == [0] and back.indices("train", greedy_only=True) == []
    assert back.answer_tokens() == 2 and back.answer_tokens("validation") == 2
    data.offsets = torch.tensor([0, 4, 11])
    data.save(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="offsets"):
        DraftData.load(tmp_path / "bad.safetensors")

"""The draft heads' training data: the target's own answers to a diverse prompt set, and text run through it.

  specdec draft-data --out DIR        the recipe, one command: DIR/draft_data.safetensors (resumable)

Where the text comes from (everything installs here; no dataset download):
- prompts: the shipped prompt set's "train" split (data/prompts.jsonl), category templates x topics
  (data/prompt_seeds.json, drawn with a fixed seed), and questions the target writes itself from the seeds'
  question instructions;
- answers: the target's greedy answer to every prompt and one drawn at temperature 0.7, top-p 0.9;
- teacher-forced text (EAGLE-1's way: any text gives features and next tokens without generating): the docstrings
  of Python's standard library, read with `ast` (nothing imported).

Held-out prompts (prompts.jsonl's "heldout" split and data/heldout_chat.jsonl) are never trained on: a training
sequence that shares a word 8-gram with one of them (or holds the whole of one shorter than 8 words) is dropped. A
"validation" share of the generated prompts (their answers) is kept apart for choosing epochs and settings.

Generation runs in shards of requests through our plain decoding with continuous batching; a shard on disk is never
redone, so an interrupted run resumes where it stopped. The file holds token ids only (features are recomputed by
training): tokens [T] int32, offsets [N + 1] int64, answer_start [N] int32 (0 for text), source [N] int8
(SOURCES), split [N] int8 (0 train, 1 validation), greedy [N] bool (the target's greedy answer), and the recipe as
JSON metadata.
"""
import ast
import json
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

SOURCES = ("shipped prompt", "template prompt", "target question", "text")
SPLITS = ("train", "validation")
SAMPLED = {"temperature": 0.7, "top_p": 0.9}


@dataclass
class Recipe:
    template_prompts: int = 2600     # category template x topic prompts
    target_questions: int = 1200     # questions the target writes from the question seeds
    sampled_answers: int = 1         # answers drawn at SAMPLED per prompt, besides the greedy one
    max_new_tokens: int = 256
    text_tokens: int = 300_000       # teacher-forced standard-library docstrings, at most
    validation_share: float = 0.04   # of the generated prompts
    seed: int = 0
    batch_size: int = 64
    shard_requests: int = 512


def _read_jsonl(name: str) -> list:
    text = resources.files("specdec_ext").joinpath(f"data/{name}").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_prompts(split: str = "train") -> list[dict]:
    """The shipped prompt set: {"category", "prompt", "split"} rows of the given split ("train", "heldout", "all")."""
    return [r for r in _read_jsonl("prompts.jsonl") if split == "all" or r["split"] == split]


def heldout_prompts() -> list[dict]:
    """Every prompt never trained on: prompts.jsonl's held-out split and the held-out chat set."""
    return load_prompts("heldout") + _read_jsonl("heldout_chat.jsonl")


def heldout_chat_prompts() -> list[dict]:
    """The held-out chat set (data/heldout_chat.jsonl): what the draft heads' acceptance is measured on."""
    return _read_jsonl("heldout_chat.jsonl")


def prompt_seeds() -> dict:
    return json.loads(resources.files("specdec_ext").joinpath("data/prompt_seeds.json").read_text())


def template_prompts(count: int, seed: int) -> list[dict]:
    """`count` distinct (category, template, topic) prompts drawn with `seed`: categories in turn, a template and a
    topic of each drawn at random."""
    seeds, rng = prompt_seeds(), random.Random(seed)
    categories = sorted(seeds["templates"])
    distinct = min(len(t) for t in seeds["templates"].values()) * len(seeds["topics"]) * len(categories)
    if count > distinct:
        raise ValueError(f"template_prompts: at most {distinct} distinct prompts, asked for {count}")
    rows, seen = [], set()
    while len(rows) < count:
        category = categories[len(rows) % len(categories)]
        template, topic = rng.choice(seeds["templates"][category]), rng.choice(seeds["topics"])
        if (template, topic) not in seen:
            seen.add((template, topic))
            rows.append({"category": category, "prompt": template.replace("{topic}", topic)})
    return rows


def question_requests(count: int, seed: int) -> list[str]:
    """Instructions asking the target to write one question each (question seed x topic)."""
    seeds, rng = prompt_seeds(), random.Random(seed + 1)
    return [rng.choice(seeds["question_seeds"]).replace("{topic}", rng.choice(seeds["topics"])) for _ in range(count)]


def clean_question(text: str) -> str | None:
    """The question a target wrote: the first quoted one, else its first line when that is one; a question ends
    with '?' and has 6-60 words. None when there is none."""
    quoted = re.search(r'"([^"\n]{10,400}\?)"', text)
    line = quoted.group(1) if quoted else next((s.strip().strip('"') for s in text.splitlines() if s.strip()), "")
    line = re.sub(r"^(question|q)\s*[:.]\s*", "", line.strip(), flags=re.IGNORECASE)
    return line if line.endswith("?") and 6 <= len(line.split()) <= 60 else None


def stdlib_docstrings() -> list[str]:
    """The docstrings (module, class, function) of the standard library's .py files, in path order, parsed with
    ast: no module is imported."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3") for part in path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))]:
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= 12:
                texts.append(doc)
    return texts


# ------------------------------------------------------------------------------------------------ held-out guard


def word_ngrams(text: str, n: int = 8) -> set:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def heldout_ngrams(n: int = 8) -> set:
    grams = set()
    for row in heldout_prompts():
        grams |= word_ngrams(row["prompt"], n)
    return grams


def check_heldout(texts, n: int = 8) -> list[int]:
    """The indices of `texts` that share a word n-gram with a held-out prompt, or hold the whole of one shorter than
    n words (case and punctuation ignored)."""
    grams = heldout_ngrams(n)
    short = [" " + " ".join(w) + " " for w in (re.findall(r"\w+", r["prompt"].lower()) for r in heldout_prompts())
             if len(w) < n]

    def shares(text: str) -> bool:
        if word_ngrams(text, n) & grams:
            return True
        words = " " + " ".join(re.findall(r"\w+", text.lower())) + " "
        return any(s in words for s in short)

    return [i for i, t in enumerate(texts) if shares(t)]


# ---------------------------------------------------------------------------------------------- generation


@dataclass
class DraftData:
    tokens: torch.Tensor          # [T] int32, every sequence back to back
    offsets: torch.Tensor         # [N + 1] int64: sequence i is tokens[offsets[i]:offsets[i + 1]]
    answer_start: torch.Tensor    # [N] int32: where the target's answer begins (0: teacher-forced text)
    source: torch.Tensor          # [N] int8: index into SOURCES
    split: torch.Tensor           # [N] int8: index into SPLITS
    greedy: torch.Tensor          # [N] bool: the answer is the target's greedy one
    recipe: dict = field(default_factory=dict)

    @classmethod
    def from_sequences(cls, sequences: list, recipe: dict | None = None) -> "DraftData":
        """From (token ids, answer_start, source, split, greedy) per sequence."""
        lengths = torch.tensor([len(s[0]) for s in sequences], dtype=torch.int64)
        return cls(tokens=torch.tensor([t for s in sequences for t in s[0]], dtype=torch.int32),
                   offsets=torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))),
                   answer_start=torch.tensor([s[1] for s in sequences], dtype=torch.int32),
                   source=torch.tensor([s[2] for s in sequences], dtype=torch.int8),
                   split=torch.tensor([s[3] for s in sequences], dtype=torch.int8),
                   greedy=torch.tensor([bool(s[4]) for s in sequences], dtype=torch.bool), recipe=recipe or {})

    def __len__(self) -> int:
        return len(self.answer_start)

    @property
    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def fingerprint(self) -> str:
        """A hash of the token ids and sequence bounds: the data a feature folder was made from."""
        import hashlib

        return hashlib.sha256(self.tokens.numpy().tobytes() + self.offsets.numpy().tobytes()).hexdigest()[:16]

    def sequence(self, i: int) -> torch.Tensor:
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])]

    def indices(self, split: str = "train", greedy_only: bool = False) -> list[int]:
        keep = (self.split == SPLITS.index(split)) & (self.greedy if greedy_only else True)
        return keep.nonzero().flatten().tolist()

    def answer_tokens(self, split: str | None = None) -> int:
        keep = torch.ones(len(self), dtype=torch.bool) if split is None else self.split == SPLITS.index(split)
        lengths = self.offsets[1:] - self.offsets[:-1] - self.answer_start.long()
        return int((lengths * (keep & (self.answer_start > 0))).sum())

    def save(self, path) -> None:
        from safetensors.torch import save_file

        save_file({"tokens": self.tokens, "offsets": self.offsets, "answer_start": self.answer_start,
                   "source": self.source, "split": self.split, "greedy": self.greedy}, str(path),
                  metadata={"recipe": json.dumps(self.recipe)})

    @classmethod
    def load(cls, path) -> "DraftData":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
                recipe = json.loads((f.metadata() or {}).get("recipe", "{}"))
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f"{path}: not a readable draft-data file: {error}") from error
        missing = {"tokens", "offsets", "answer_start", "source", "split", "greedy"} - tensors.keys()
        if missing:
            raise ValueError(f"{path}: not a draft-data file (missing {sorted(missing)})")
        n = len(tensors["answer_start"])
        if len(tensors["offsets"]) != n + 1 or int(tensors["offsets"][-1]) != len(tensors["tokens"]):
            raise ValueError(f"{path}: offsets do not match the tokens")
        return cls(**tensors, recipe=recipe)


def generate_shards(target, requests: list, out_dir: Path, stage: str, recipe: Recipe, *, eos_token_id,
                    progress: bool = True) -> list:
    """Answers to requests [(prompt ids, temperature, top_p, seed)] in shards of recipe.shard_requests, each saved
    as out_dir/{stage}-NNNN.pt once done and loaded instead of regenerated. Returns the answers (token lists)."""
    from tqdm import tqdm

    from .engine import SpeculativeDecoder

    out_dir.mkdir(parents=True, exist_ok=True)
    decoder = SpeculativeDecoder(target, None, max_batch_size=recipe.batch_size)
    answers = []
    shards = range(0, len(requests), recipe.shard_requests)
    for number, first in enumerate(tqdm(shards, desc=stage, unit="shard", disable=not progress)):
        path = out_dir / f"{stage}-{number:04d}.pt"
        chunk = requests[first:first + recipe.shard_requests]
        if path.exists():
            saved = torch.load(path)
            if saved["requests"] == chunk:
                answers += saved["answers"]
                continue
        out = decoder.generate_autoregressive(
            [r[0] for r in chunk], recipe.max_new_tokens, temperature=[r[1] for r in chunk],
            top_p=[r[2] for r in chunk], seed=[r[3] for r in chunk], eos_token_id=eos_token_id)
        torch.save({"requests": chunk, "answers": out.sequences}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)  # a shard is on disk whole or not at all
        answers += out.sequences
    return answers


def make_draft_data(target, tokenizer, out_dir, recipe: Recipe = Recipe(), *, model_name: str = "",
                    progress: bool = True) -> DraftData:
    """The recipe's data (module docstring), generated by `target` in shards under out_dir/shards and written to
    out_dir/draft_data.safetensors. Returns it."""
    from .factory import prompt_ids

    out_dir, start = Path(out_dir), time.perf_counter()
    shards, eos = out_dir / "shards", tokenizer.eos_token_id
    # 1. Questions the target writes itself.
    asks = question_requests(recipe.target_questions, recipe.seed)
    written = generate_shards(target, [(prompt_ids(tokenizer, a), 0.9, 0.95, recipe.seed * 100_000 + i)
                                       for i, a in enumerate(asks)], shards, "questions",
                              Recipe(**{**vars(recipe), "max_new_tokens": 64}), eos_token_id=eos, progress=progress)
    questions = list(dict.fromkeys(q for q in (clean_question(tokenizer.decode(w, skip_special_tokens=True))
                                               for w in written) if q))
    # 2. The prompt set; a validation share of the generated prompts.
    prompts = [(r["prompt"], 0) for r in load_prompts("train")]
    prompts += [(r["prompt"], 1) for r in template_prompts(recipe.template_prompts, recipe.seed)]
    prompts += [(q, 2) for q in questions]
    rng = random.Random(recipe.seed + 2)
    splits = [0 if source == 0 or rng.random() >= recipe.validation_share else 1 for _, source in prompts]
    # 3. Answers: greedy, then sampled (seeds distinct per request).
    n = 1 + recipe.sampled_answers
    requests, owners = [], []
    for i, (text, _) in enumerate(prompts):
        ids = prompt_ids(tokenizer, text)
        for a in range(n):
            sampled = a > 0
            requests.append((ids, SAMPLED["temperature"] if sampled else 0.0, SAMPLED["top_p"] if sampled else 1.0,
                             recipe.seed * 1_000_000 + i * n + a))
            owners.append(i)
    answers = generate_shards(target, requests, shards, "answers", recipe, eos_token_id=eos, progress=progress)
    sequences, texts = [], []
    for (ids, temperature, *_), answer, i in zip(requests, answers, owners):
        sequences.append((ids + answer, len(ids), prompts[i][1], splits[i], temperature == 0.0))
        texts.append(prompts[i][0] + "\n" + tokenizer.decode(answer, skip_special_tokens=True))
    # 4. Teacher-forced text, whole docstrings up to the token budget.
    total = 0
    for doc in stdlib_docstrings():
        ids = tokenizer(doc)["input_ids"][:512]
        if total + len(ids) > recipe.text_tokens:
            break
        sequences.append((ids, 0, 3, 0, False))
        texts.append(doc)
        total += len(ids)
    # 5. Nothing that shares a word 8-gram with a held-out prompt.
    dropped = set(check_heldout(texts))
    data = DraftData.from_sequences(
        [s for i, s in enumerate(sequences) if i not in dropped],
        recipe={**vars(recipe), "model": model_name,
                "activations": getattr(target, "activations", "float"), "python": sys.version.split()[0],
                "questions_kept": len(questions), "dropped_for_heldout": len(dropped),
                "seconds": round(time.perf_counter() - start)})
    data.save(out_dir / "draft_data.safetensors")
    return data

"""Writes ``corpus_mc.jsonl`` (``tests/test_lm_eval.py``'s task): multiple-choice items built from the bundled
corpus that the trained tiny checkpoints learned. Each item's context is the first words of a corpus line; its
choices are the line's next words and the words at the same place in three other lines. Deterministic: run it
again after changing the corpus (``python tests/data/lm_eval/make_corpus_mc.py``) and commit the JSONL.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[3] / "worker" / "checkpoint" / "corpus.txt"
OUT = Path(__file__).with_name("corpus_mc.jsonl")
ITEMS, CONTEXT_WORDS, CHOICE_WORDS, CHOICES, SEED = 36, 10, 6, 4, 0


def items(corpus: str) -> list[dict]:
    lines = [ln.strip() for ln in corpus.splitlines() if len(ln.split()) >= CONTEXT_WORDS + CHOICE_WORDS + 4]
    rng = random.Random(SEED)
    picked = sorted(rng.sample(range(len(lines)), ITEMS))
    cont = {i: " ".join(lines[i].split()[CONTEXT_WORDS:CONTEXT_WORDS + CHOICE_WORDS]) for i in range(len(lines))}
    out = []
    for i in picked:
        others = [j for j in range(len(lines)) if cont[j] != cont[i]]
        distractors = []
        for j in rng.sample(others, len(others)):
            if cont[j] not in distractors:
                distractors.append(cont[j])
            if len(distractors) == CHOICES - 1:
                break
        label = rng.randrange(CHOICES)
        choices = distractors[:label] + [cont[i]] + distractors[label:]
        out.append({"id": len(out), "context": " ".join(lines[i].split()[:CONTEXT_WORDS]), "choices": choices,
                    "label": label})
    return out


if __name__ == "__main__":
    OUT.write_text("".join(json.dumps(item) + "\n" for item in items(CORPUS.read_text())))
    print(f"wrote {OUT}")

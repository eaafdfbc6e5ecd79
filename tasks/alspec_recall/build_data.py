"""Builds recall.jsonl: passages of A Tale of Two Cities with a code hidden in the middle.

Answering needs attention between the first and the last window (beyond S = 64 tokens from
either end), so pure sink attention loses it and dynamic speculation must keep it. Run once; the output is committed.
The source is Project Gutenberg's plain-text eBook #98 (public domain), header and footer included:
    python tasks/alspec_recall/build_data.py pg98.txt
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def gutenberg_body(text: str) -> str:
    start = text.index("*** START OF")
    end = text.index("*** END OF")
    return text[text.index("\n", start) + 1:end]


def build(source: Path, out: Path, docs: int = 16, words: int = 420, seed: int = 1234) -> None:
    rng = random.Random(seed)
    body = gutenberg_body(source.read_text(encoding="utf-8")).split()
    with out.open("w") as f:
        for i in range(docs):
            start = rng.randrange(len(body) - words)
            passage = body[start:start + words]
            code = str(rng.randrange(1000, 10000))
            passage.insert(rng.randrange(words // 3, 2 * words // 3), f"(Remember this: the secret code is {code}.)")
            text = " ".join(passage)
            f.write(json.dumps({"id": i, "passage": text, "code": code}) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(__file__).with_name("recall.jsonl"))

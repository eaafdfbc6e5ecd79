"""Needle-in-a-haystack prompts sized in tokens of the model under test.

Attention-sink approximation drops everything between the first and the last S
cached tokens, so a needle in the middle of a long context is exactly what it
loses. These prompts measure that: `paper` mode reproduces the ALSpec paper's
Appendix G test (7 MD5 hashes and 3 made-up facts in a 16K haystack), `single`
mode places one needle at a chosen depth for length x depth grids.

Everything is deterministic under `seed` (a private `random.Random`, never the
global RNG), and imports neither torch nor transformers: the tokenizer is
duck-typed (a Hugging Face tokenizer, or any callable returning a token count).
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

Mode = Literal["paper", "single"]
NeedleKind = Literal["hash", "fact", "passkey"]

PAPER_INSTRUCTION = (
    "Answer the following questions if you can. "
    "If you don't know the answer, answer I don't know."
)
HASH_REQUEST = "Repeat Hash 1 to Hash 7 exactly as they appear in the text."
PASSKEY_QUESTION = "What is the pass key mentioned in the text above?"
# Single mode tells the model up front what to look for and starts its answer: small models
# (SmolLM2-135M) then retrieve a pass key at 2K tokens, which they rarely do when asked only at the end.
SINGLE_INTRO = {
    "passkey": "There is an important pass key hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the pass key.\n\n",
    "fact": "There is an important fact hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about it.\n\n",
}
SINGLE_ANSWER_PREFIX = {"passkey": "The pass key is", "fact": "The answer is"}
PAPER_HASHES = 7
SUPPORTED_LENGTHS = tuple(2**k for k in range(10, 18))  # 1K .. 128K: the lengths the lm-eval task reports
PAPER_FACTS = 3

# (statement, question, key answer). The key answers never occur in the haystack
# text, so finding one in a model's answer means the needle was retrieved.
FACTS: tuple[tuple[str, str, str], ...] = (
    (
        "The secret ingredient of Mrs. Higgins' pie is cardamom.",
        "What is the secret ingredient of Mrs. Higgins' pie?",
        "cardamom",
    ),
    (
        "The name of Captain Oduya's parrot is Pistachio.",
        "What is the name of Captain Oduya's parrot?",
        "Pistachio",
    ),
    (
        "The lighthouse on Varn Island is painted turquoise.",
        "What colour is the lighthouse on Varn Island painted?",
        "turquoise",
    ),
    (
        "Professor Lindqvist plays the harpsichord every Sunday.",
        "Which instrument does Professor Lindqvist play every Sunday?",
        "harpsichord",
    ),
    (
        "The password to the Quill Street library vault is marmalade.",
        "What is the password to the Quill Street library vault?",
        "marmalade",
    ),
    (
        "The town of Elmbridge Hollow was founded by a beekeeper named Ottoline.",
        "What was the name of the beekeeper who founded Elmbridge Hollow?",
        "Ottoline",
    ),
    (
        "The mascot of the Harwick rowing club is a mongoose.",
        "What is the mascot of the Harwick rowing club?",
        "mongoose",
    ),
    (
        "Inspector Halloran's favourite tea is rooibos.",
        "What is Inspector Halloran's favourite tea?",
        "rooibos",
    ),
    (
        "The only tree in Greymoor Square is a ginkgo.",
        "What is the only tree in Greymoor Square?",
        "ginkgo",
    ),
    (
        "The first ship launched from Port Selwyn was named the Periwinkle.",
        "What was the name of the first ship launched from Port Selwyn?",
        "Periwinkle",
    ),
)

# A word ending a sentence, and the abbreviations that look like one but are not.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
_ABBREVIATIONS = frozenset({"Mr.", "Mrs.", "Dr.", "St.", "Co.", "Messrs.", "Mme.", "Mlle.", "M."})


@dataclass(frozen=True)
class Needle:
    """One inserted fact and what a correct answer must contain."""

    kind: NeedleKind
    text: str  # the sentence inserted into the haystack
    answer: str  # the string scoring looks for in the model's answer
    position_tokens: int  # tokens of the final prompt before the needle
    depth: float  # where it sits, as a fraction of the haystack's words


@dataclass(frozen=True)
class NeedleSample:
    """A generated prompt with its needles; `length` is the requested token count."""

    prompt: str  # what the model is given (chat template applied if `chat`)
    text: str  # the same prompt before the chat template
    needles: list[Needle]
    context_tokens: int  # tokens of `prompt`, as the tokenizer counts them
    mode: Mode
    seed: int
    length: int
    depth: float | None  # requested needle depth (single mode only)
    chat: bool


def tolerance(length: int) -> int:
    """How far below `length` a generated prompt may fall: 1%, at least 16 tokens."""
    return max(16, length // 100)


@dataclass(frozen=True)
class _Corpus:
    words: tuple[str, ...]
    starts: tuple[int, ...]  # word indices that begin a sentence, ascending, starts[0] == 0


def _ends_sentence(words: tuple[str, ...], i: int) -> bool:
    """Whether words[i] closes a sentence; a lone closing quote closes it if its
    predecessor does (the shipped text sets some quotes apart with spaces)."""
    if words[i] in ('"', "'"):
        return i > 0 and _ends_sentence(words, i - 1)
    return bool(_SENTENCE_END.search(words[i])) and words[i] not in _ABBREVIATIONS


def _begins_sentence(word: str) -> bool:
    return word[0].isupper() or (word[0] in "\"'" and len(word) > 1)


@cache
def _corpus() -> _Corpus:
    """The shipped haystack as words, whitespace collapsed (the file keeps Gutenberg's
    line layout, which would otherwise put arbitrary runs of spaces into prompts)."""
    text = (resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8")
    words = tuple(text.split())
    starts = [0] + [
        i for i in range(1, len(words)) if _ends_sentence(words, i - 1) and _begins_sentence(words[i])
    ]
    return _Corpus(words, tuple(starts))


def _window(corpus: _Corpus, start: int, n: int) -> list[str]:
    """`n` words from `start`, wrapping around to repeat the text for long contexts."""
    out: list[str] = []
    while len(out) < n:
        out.extend(corpus.words[start : start + n - len(out)])
        start = 0
    return out


def _boundary(corpus: _Corpus, start: int, n: int, depth: float) -> int:
    """The sentence boundary of the `n`-word window at `start` nearest to `depth`, as a
    word offset in 0..n. The window's end is a boundary only where a sentence begins,
    so a needle never follows the cut-off last sentence."""
    target = round(depth * n)
    total = len(corpus.words)
    wraps, offset = divmod(start + target, total)
    i = bisect.bisect_right(corpus.starts, offset)  # >= 1 since starts[0] == 0
    before = corpus.starts[i - 1]
    after = corpus.starts[i] if i < len(corpus.starts) else total
    candidates = [wraps * total + s - start for s in (before, after)]
    return min((c for c in candidates if c <= n), key=lambda c: abs(c - target))


def _token_counter(tokenizer: Any, chat: bool) -> Callable[[str], int]:
    """Tokens the model would see for a prompt. A chat-templated prompt already holds its
    special tokens; a raw one gets the tokenizer's own (BOS, if any)."""
    if hasattr(tokenizer, "encode"):
        return lambda s: len(tokenizer.encode(s, add_special_tokens=not chat))
    return tokenizer


def _resolve_chat(tokenizer: Any, chat: bool | None) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise ValueError("chat=True needs a tokenizer with a chat template")
    return has_template if chat is None else chat


def _apply_chat(tokenizer: Any, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _fit(measure: Callable[[int], int], length: int) -> int:
    """Most haystack words whose prompt stays within `length` tokens.

    The count is near-linear in words, so interpolation lands within a few tokens in a
    handful of tokenizations even at 128K; a step that fails to halve the bracket is
    followed by a bisection so that an uneven count still converges.
    """
    lo, f_lo = 0, measure(0)
    if f_lo > length:
        raise ValueError(f"needles and questions alone take {f_lo} tokens, over {length}")
    hi = length  # a word is at least about one token, so this usually overshoots
    f_hi = measure(hi)
    while f_hi <= length:
        lo, f_lo, hi = hi, f_hi, hi * 2
        f_hi = measure(hi)
    bisect_next = False
    while hi - lo > 1 and length - f_lo > 1:
        width = hi - lo
        if bisect_next:
            mid = (lo + hi) // 2
        else:
            mid = lo + (length - f_lo) * (hi - lo) // (f_hi - f_lo)
            mid = min(max(mid, lo + 1), hi - 1)
        f_mid = measure(mid)
        if f_mid <= length:
            lo, f_lo = mid, f_mid
        else:
            hi, f_hi = mid, f_mid
        bisect_next = (hi - lo) * 2 > width
    return lo


@dataclass(frozen=True)
class _Spec:
    """What to insert and where, before the haystack is sized."""

    kinds: list[NeedleKind]
    texts: list[str]
    answers: list[str]
    depths: list[float]
    question: str
    intro: str = ""  # said before the haystack
    answer_prefix: str = ""  # the start of the model's answer, given in the prompt


def _build(
    tokenizer: Any, spec: _Spec, length: int, rng: random.Random, chat: bool | None
) -> tuple[str, str, list[Needle], int, bool]:
    corpus = _corpus()
    use_chat = _resolve_chat(tokenizer, chat)
    count = _token_counter(tokenizer, use_chat)
    start = rng.choice(corpus.starts)

    def render(n: int) -> tuple[str, str, list[int]]:
        words = _window(corpus, start, n)
        at = [_boundary(corpus, start, n, d) for d in spec.depths]
        pieces: list[str] = []
        prev = 0
        for i in sorted(range(len(at)), key=lambda i: at[i]):
            pieces += [" ".join(words[prev : at[i]]), spec.texts[i]]
            prev = at[i]
        pieces.append(" ".join(words[prev:]))
        text = spec.intro + " ".join(p for p in pieces if p) + "\n\n" + spec.question
        if use_chat:
            return text, _apply_chat(tokenizer, text) + spec.answer_prefix, at
        return text, f"{text}\n\nAnswer: {spec.answer_prefix}" if spec.answer_prefix else text, at

    n = _fit(lambda n: count(render(n)[1]), length)
    text, prompt, at = render(n)
    tokens = count(prompt)
    if length - tokens > tolerance(length):
        raise RuntimeError(f"prompt of {tokens} tokens is not within tolerance of {length}")
    needles = [
        Needle(kind, t, answer, count(prompt[: prompt.index(t)]), pos / n if n else 0.0)
        for kind, t, answer, pos in zip(spec.kinds, spec.texts, spec.answers, at)
    ]
    return text, prompt, needles, tokens, use_chat


def _md5(rng: random.Random) -> str:
    return hashlib.md5(rng.randbytes(16)).hexdigest()


def make_paper_sample(
    tokenizer: Any, length: int = 16384, seed: int = 0, chat: bool | None = None
) -> NeedleSample:
    """The paper's Appendix G prompt: 7 hashes and 3 facts at random sentence boundaries
    of a `length`-token haystack, then the questions. Scored out of 10."""
    rng = random.Random(seed)
    hashes = [_md5(rng) for _ in range(PAPER_HASHES)]
    facts = rng.sample(FACTS, PAPER_FACTS)
    questions = [q for _, q, _ in facts] + [HASH_REQUEST]
    spec = _Spec(
        kinds=["hash"] * PAPER_HASHES + ["fact"] * PAPER_FACTS,
        texts=[f"Hash {i}: {h}." for i, h in enumerate(hashes, 1)] + [s for s, _, _ in facts],
        answers=hashes + [a for _, _, a in facts],
        depths=[rng.random() for _ in range(PAPER_HASHES + PAPER_FACTS)],
        question="\n".join(
            [PAPER_INSTRUCTION] + [f"{i}. {q}" for i, q in enumerate(questions, 1)]
        ),
    )
    text, prompt, needles, tokens, use_chat = _build(tokenizer, spec, length, rng, chat)
    return NeedleSample(prompt, text, needles, tokens, "paper", seed, length, None, use_chat)


def make_single_sample(
    tokenizer: Any,
    length: int,
    depth: float,
    seed: int = 0,
    kind: Literal["passkey", "fact"] = "passkey",
    chat: bool | None = None,
) -> NeedleSample:
    """One needle at the sentence boundary nearest `depth` (0 = start, 1 = end of the
    haystack), then the question for it. Scored 1 or 0."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    if kind == "passkey":
        key = str(rng.randint(10000, 99999))
        needle = (f"The pass key is {key}. Remember it. {key} is the pass key.", PASSKEY_QUESTION, key)
    elif kind == "fact":
        needle = rng.choice(FACTS)
    else:
        raise ValueError(f"unknown needle kind {kind!r}")
    statement, question, answer = needle
    spec = _Spec([kind], [statement], [answer], [depth], question, intro=SINGLE_INTRO[kind],
                 answer_prefix=SINGLE_ANSWER_PREFIX[kind])
    text, prompt, needles, tokens, use_chat = _build(tokenizer, spec, length, rng, chat)
    return NeedleSample(prompt, text, needles, tokens, "single", seed, length, depth, use_chat)

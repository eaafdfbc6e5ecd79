"""Scoring on hand-written answers."""

from __future__ import annotations

import pytest

from alspec_eval.niah import Needle, make_paper_sample, make_single_sample, score_answer, score_needles


def count_words(text: str) -> int:
    """A tokenizer stand-in (one token per word, no chat template): fast and exact."""
    return len(text.split())

PAPER = make_paper_sample(count_words, 1024, seed=0)
HASHES = [n.answer for n in PAPER.needles[:7]]
FACTS = [n.answer for n in PAPER.needles[7:]]


def test_all_right() -> None:
    answer = (
        f"1. It is {FACTS[0].upper()}.\n2. {FACTS[1]}\n3. {FACTS[2].capitalize()}!\n"
        + "\n".join(f"Hash {i}: {h}" for i, h in enumerate(HASHES, 1))
    )
    score = score_answer(PAPER, answer)
    assert (score.found, score.total, score.fraction) == (10, 10, 1.0)
    assert score.per_needle == [True] * 10


def test_all_wrong() -> None:
    wrong_hashes = [h[:-1] + ("0" if h[-1] != "0" else "1") for h in HASHES]
    answer = "1. nutmeg\n2. Bob\n3. mauve\n" + "\n".join(wrong_hashes)
    score = score_answer(PAPER, answer)
    assert (score.found, score.total, score.fraction) == (0, 10, 0.0)


def test_partially_right() -> None:
    answer = (
        f"1. I don't know. 2. {FACTS[1].upper()} 3. I don't know.\n"
        f"Hash 1: {HASHES[0]}\nHash 2: {HASHES[1][:31]}\nHash 4: {HASHES[3]}\nHash 7: {HASHES[6]}x"
    )
    score = score_answer(PAPER, answer)
    assert score.found == 4 and score.total == 10 and score.fraction == pytest.approx(0.4)
    assert score.per_needle == [True, False, False, True, False, False, True, False, True, False]


def test_i_dont_know() -> None:
    assert score_answer(PAPER, "I don't know.").found == 0
    assert score_answer(make_single_sample(count_words, 1024, 0.5), "I don't know.").found == 0


def test_hash_match_is_exact() -> None:
    needle = Needle("hash", "Hash 1: x.", "0123456789abcdef0123456789abcdef", 0, 0.5)
    assert score_needles([needle], "it was 0123456789abcdef0123456789abcdef").found == 1
    assert score_needles([needle], "0123456789ABCDEF0123456789ABCDEF").found == 0


@pytest.mark.parametrize(
    ("answer", "found"),
    [("The pass key is 71432.", 1), ("71432", 1), ("714320", 0), ("171432", 0), ("7143 2", 0)],
)
def test_passkey_must_be_a_whole_number(answer: str, found: int) -> None:
    needle = Needle("passkey", "The pass key is 71432. Remember it. 71432 is the pass key.", "71432", 0, 0.5)
    score = score_needles([needle], answer)
    assert (score.found, score.total) == (found, 1)


def test_single_sample_scored_out_of_one() -> None:
    sample = make_single_sample(count_words, 1024, 0.5, seed=7, kind="fact")
    (needle,) = sample.needles
    assert score_answer(sample, f"The answer is {needle.answer.lower()}.").fraction == 1.0
    assert score_answer(sample, "The answer is tea.").fraction == 0.0

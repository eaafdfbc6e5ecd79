"""The generator: determinism, token length, needle placement, chat templates."""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import pytest

from alspec_eval.niah import FACTS, NeedleSample, make_paper_sample, make_single_sample, tolerance


def count_words(text: str) -> int:
    """A tokenizer stand-in (one token per word, no chat template): fast and exact."""
    return len(text.split())

HEX32 = re.compile(r"[0-9a-f]{32}")


def haystack_text() -> str:
    return (resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8")


def assert_fits(sample: NeedleSample, tokens: int) -> None:
    assert tokens == sample.context_tokens
    assert sample.length - tolerance(sample.length) <= tokens <= sample.length


def test_haystack_is_the_book_without_gutenberg_boilerplate() -> None:
    text = haystack_text()
    assert "gutenberg" not in text.lower()
    assert "*** START OF" not in text and "*** END OF" not in text
    assert text.startswith("A TALE OF TWO CITIES")
    assert text.rstrip().endswith('than I have ever known.\n "')
    assert "It was the best of times, it was the worst of times" in text
    license_note = (resources.files("alspec_eval") / "data" / "HAYSTACK_LICENSE.txt").read_text()
    assert "public domain" in license_note.lower()


def test_fact_answers_never_occur_in_the_haystack() -> None:
    """Otherwise a model could score a fact without retrieving its needle."""
    text = haystack_text().lower()
    assert len(FACTS) >= 10
    for statement, question, answer in FACTS:
        assert answer.lower() not in text
        assert answer in statement and answer.lower() not in question.lower()


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: make_paper_sample(count_words, 2048, seed=seed),
        lambda seed: make_single_sample(count_words, 2048, 0.5, seed=seed),
        lambda seed: make_single_sample(count_words, 2048, 0.5, seed=seed, kind="fact"),
    ],
    ids=["paper", "passkey", "fact"],
)
def test_same_seed_same_sample_other_seed_other_sample(make: Any) -> None:
    assert make(3) == make(3)
    assert make(4).prompt != make(3).prompt
    assert len({tuple(n.answer for n in make(seed).needles) for seed in range(5)}) > 1


def test_seed_does_not_touch_global_random_state() -> None:
    import random

    random.seed(0)
    expected = random.random()
    random.seed(0)
    make_paper_sample(count_words, 1024, seed=1)
    assert random.random() == expected


@pytest.mark.parametrize("length", [1024, 2048, 4096])
@pytest.mark.parametrize("chat", [True, False])
def test_paper_length_within_tolerance(smollm2_tokenizer: Any, length: int, chat: bool) -> None:
    sample = make_paper_sample(smollm2_tokenizer, length, seed=length, chat=chat)
    assert_fits(sample, len(smollm2_tokenizer.encode(sample.prompt, add_special_tokens=not chat)))


@pytest.mark.parametrize("length", [1024, 2048, 4096])
@pytest.mark.parametrize("kind", ["passkey", "fact"])
def test_single_length_within_tolerance(smollm2_tokenizer: Any, length: int, kind: str) -> None:
    sample = make_single_sample(smollm2_tokenizer, length, 0.3, seed=1, kind=kind)
    assert_fits(sample, len(smollm2_tokenizer.encode(sample.prompt, add_special_tokens=False)))


def test_128k_context(smollm2_tokenizer: Any) -> None:
    sample = make_single_sample(smollm2_tokenizer, 131072, 0.5, seed=0, chat=False)
    assert_fits(sample, len(smollm2_tokenizer.encode(sample.prompt)))


def test_text_repeats_for_contexts_longer_than_the_book() -> None:
    book_words = len(haystack_text().split())
    length = 2 * book_words + 1000
    sample = make_single_sample(count_words, length, 0.5, seed=0)
    assert_fits(sample, count_words(sample.prompt))
    assert sample.prompt.count("It was the best of times, it was the worst of times") >= 2


def test_paper_sample_layout() -> None:
    sample = make_paper_sample(count_words, 2048, seed=5)
    kinds = [n.kind for n in sample.needles]
    assert kinds == ["hash"] * 7 + ["fact"] * 3
    hashes = [n.answer for n in sample.needles[:7]]
    assert all(HEX32.fullmatch(h) for h in hashes) and len(set(hashes)) == 7
    for i, needle in enumerate(sample.needles[:7], 1):
        assert needle.text == f"Hash {i}: {needle.answer}."
    facts = {statement: (question, answer) for statement, question, answer in FACTS}
    questions = [facts[n.text][0] for n in sample.needles[7:]]
    assert [facts[n.text][1] for n in sample.needles[7:]] == [n.answer for n in sample.needles[7:]]
    assert len(set(questions)) == 3
    assert sample.text.endswith(
        "\n\nAnswer the following questions if you can. If you don't know the answer, answer I don't know.\n"
        + "".join(f"{i}. {q}\n" for i, q in enumerate(questions, 1))
        + "4. Repeat Hash 1 to Hash 7 exactly as they appear in the text."
    )
    assert (sample.mode, sample.seed, sample.length, sample.depth) == ("paper", 5, 2048, None)


def test_paper_needles_vary_their_facts_with_the_seed() -> None:
    chosen = {n.text for seed in range(8) for n in make_paper_sample(count_words, 1024, seed=seed).needles[7:]}
    assert len(chosen) > 3


@pytest.mark.parametrize(
    "sample",
    [
        make_paper_sample(count_words, 4096, seed=0),
        make_paper_sample(count_words, 1024, seed=9),
        make_single_sample(count_words, 2048, 0.0, seed=2),
        make_single_sample(count_words, 2048, 1.0, seed=2, kind="fact"),
    ],
    ids=["paper-4k", "paper-1k", "passkey-start", "fact-end"],
)
def test_every_needle_once_at_a_sentence_boundary(sample: NeedleSample) -> None:
    starts = []
    for needle in sample.needles:
        assert sample.prompt.count(needle.text) == 1
        # the answer occurs nowhere but in its needle
        assert sample.prompt.count(needle.answer) == needle.text.count(needle.answer)
        start = sample.prompt.index(needle.text)
        before = sample.prompt[:start].split()
        after = sample.prompt[start + len(needle.text) :].split()
        if before and before[-1] == '"':  # a closing quote the text sets apart
            before.pop()
        assert not before or re.search(r"[.!?][\"')\]]*$", before[-1]), before[-3:]
        assert after[0][0].isupper() or after[0][0] in "\"'", after[:3]
        starts.append(start)
    order = sorted(range(len(starts)), key=starts.__getitem__)
    assert [sample.needles[i].position_tokens for i in order] == sorted(n.position_tokens for n in sample.needles)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_single_depth_is_respected(smollm2_tokenizer: Any, depth: float) -> None:
    sample = make_single_sample(smollm2_tokenizer, 4096, depth, seed=0, chat=False)
    (needle,) = sample.needles
    assert abs(needle.depth - depth) < 0.03
    assert abs(needle.position_tokens / sample.context_tokens - depth) < 0.05
    assert sample.depth == depth and sample.mode == "single"


def test_passkey_needle() -> None:
    (needle,) = make_single_sample(count_words, 1024, 0.5, seed=0).needles
    assert re.fullmatch(r"\d{5}", needle.answer)
    assert needle.text == f"The pass key is {needle.answer}. Remember it. {needle.answer} is the pass key."


def test_chat_template_auto(smollm2_tokenizer: Any) -> None:
    auto = make_single_sample(smollm2_tokenizer, 1024, 0.5, seed=0)
    raw = make_single_sample(smollm2_tokenizer, 1024, 0.5, seed=0, chat=False)
    assert auto.chat and auto.prompt.startswith("<|im_start|>")
    assert auto.text in auto.prompt and auto.prompt.endswith("<|im_start|>assistant\nThe pass key is")
    assert auto.text.startswith("There is an important pass key hidden")
    assert not raw.chat and raw.prompt == raw.text + "\n\nAnswer: The pass key is"
    assert make_single_sample(count_words, 1024, 0.5).chat is False
    with pytest.raises(ValueError, match="chat template"):
        make_single_sample(count_words, 1024, 0.5, chat=True)


def test_rejects_impossible_requests() -> None:
    with pytest.raises(ValueError, match="depth"):
        make_single_sample(count_words, 1024, 1.5)
    with pytest.raises(ValueError, match="kind"):
        make_single_sample(count_words, 1024, 0.5, kind="riddle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alone take"):
        make_paper_sample(count_words, 64)

"""lm-eval glue for the needle-in-a-haystack tasks.

Like lm-eval's own `ruler` tasks, the documents are generated at load time through
`custom_dataset`, sized with the tokenizer of the model under test. Everything the
generator needs arrives in the task metadata, which lm-eval fills from `--metadata`
(a JSON object) merged over `--model_args`:

- `tokenizer` or `pretrained` (+ `gguf_file` for a GGUF checkpoint): the tokenizer.
- `max_seq_lengths`: prompt lengths in tokens, each one of `SUPPORTED_LENGTHS`.
- `niah_depths` (single mode): needle depths, fractions of the haystack.
- `niah_samples`: samples per length (paper mode) or per length and depth.
- `niah_seed`: sample i uses seed `niah_seed + i`, so the same needles recur across
  lengths and depths and the cells of a grid differ only in length and depth.
- `niah_needle` (single mode): `passkey` or `fact`.
- `niah_chat`: bake the tokenizer's chat template into the prompt (true, false, or
  auto: when the tokenizer has one; the default). Baked in, the template's tokens count
  toward the requested length and single mode's answer prefix ("The pass key is") opens
  the assistant's turn; so run without `--apply_chat_template`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import datasets

from alspec_eval.smollm2 import SMOLLM2_ALIAS, smollm2_path
from alspec_eval.niah import SUPPORTED_LENGTHS, Needle, NeedleSample, make_paper_sample, make_single_sample, score_needles

# One metric per length, named by the length (as ruler does). The YAMLs list exactly these.
PAPER_DEFAULTS = {"max_seq_lengths": [16384], "niah_samples": 10}
SINGLE_DEFAULTS = {"max_seq_lengths": [4096], "niah_samples": 5, "niah_depths": [0.0, 0.25, 0.5, 0.75, 1.0]}


@cache
def load_tokenizer(name: str, gguf_file: str | None) -> Any:
    """Load once per process: lm-eval builds the dataset of each task separately."""
    from transformers import AutoTokenizer

    if gguf_file:
        return AutoTokenizer.from_pretrained(name, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(name)


def _tokenizer(metadata: dict[str, Any]) -> Any:
    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if not name:
        raise ValueError(
            "alspec_niah sizes its prompts in tokens and needs a tokenizer: pass "
            "--model_args pretrained=... or --metadata '{\"tokenizer\": ...}'"
        )
    if name == SMOLLM2_ALIAS:
        name = smollm2_path()
    return load_tokenizer(str(name), metadata.get("gguf_file"))


def _lengths(metadata: dict[str, Any]) -> list[int]:
    lengths = [int(n) for n in metadata["max_seq_lengths"]]
    unsupported = [n for n in lengths if n not in SUPPORTED_LENGTHS]
    if unsupported:
        raise ValueError(f"max_seq_lengths {unsupported} not among {list(SUPPORTED_LENGTHS)}")
    return lengths


def _chat(metadata: dict[str, Any]) -> bool | None:
    """`niah_chat` may arrive as JSON (true/false/null) or as a model_args string."""
    value = metadata.get("niah_chat")
    if isinstance(value, str):
        return {"true": True, "false": False, "auto": None, "none": None}[value.lower()]
    return value


def to_doc(sample: NeedleSample) -> dict[str, Any]:
    """The document lm-eval keeps. The raw text is left out: the prompt is enough to
    evaluate, and the samples log would otherwise hold each long prompt twice."""
    return {
        "input": sample.prompt,
        "answers": [n.answer for n in sample.needles],
        "needles": [vars(n) for n in sample.needles],
        "max_length": sample.length,
        "context_tokens": sample.context_tokens,
        "depth": sample.depth,
        "mode": sample.mode,
        "seed": sample.seed,
    }


def _dataset(docs: list[dict[str, Any]]) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list(docs, split=datasets.Split.TEST)}


def niah_paper(**metadata: Any) -> dict[str, datasets.Dataset]:
    """Paper mode (Appendix G): 7 hashes and 3 facts per prompt, scored out of 10."""
    metadata = PAPER_DEFAULTS | metadata
    tokenizer, chat, seed = _tokenizer(metadata), _chat(metadata), int(metadata.get("niah_seed", 0))
    return _dataset(
        [
            to_doc(make_paper_sample(tokenizer, length, seed=seed + i, chat=chat))
            for length in _lengths(metadata)
            for i in range(int(metadata["niah_samples"]))
        ]
    )


def niah_single(**metadata: Any) -> dict[str, datasets.Dataset]:
    """Single mode: one needle per prompt over a length x depth grid, scored 1 or 0."""
    metadata = SINGLE_DEFAULTS | metadata
    tokenizer, chat, seed = _tokenizer(metadata), _chat(metadata), int(metadata.get("niah_seed", 0))
    kind = metadata.get("niah_needle", "passkey")
    return _dataset(
        [
            to_doc(make_single_sample(tokenizer, length, float(depth), seed=seed + i, kind=kind, chat=chat))
            for length in _lengths(metadata)
            for depth in metadata["niah_depths"]
            for i in range(int(metadata["niah_samples"]))
        ]
    )


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Fraction of the document's needles found, under its length's metric only (lengths
    that were not run then report nothing rather than a placeholder)."""
    score = score_needles([Needle(**n) for n in doc["needles"]], results[0])
    return {str(doc["max_length"]): score.fraction}


def aggregate(scores: list[float]) -> float:
    return sum(scores) / len(scores)

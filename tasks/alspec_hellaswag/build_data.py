"""Builds hellaswag.jsonl: HellaSwag validation items (Zellers et al. 2019, MIT, see HELLASWAG_LICENSE.txt).

The source is the validation split as text, six lines per item (`activity_label: ctx`, label, four endings), as
extracted for llama.cpp's HellaSwag scorer by github.com/klosax/hellaswag_text_data (`hellaswag_val_full.txt.bz2`):
no dataset hub is reachable here. The first `test` items are the evaluation set, the next `train` the few-shot pool.
lm-eval's own HellaSwag preprocessing is applied; unlike lm-eval's task, the last context sentence is not
capitalized (the extraction joins ctx_a and ctx_b). Run once; the output is committed:
    python tasks/alspec_hellaswag/build_data.py hellaswag_val_full.txt.bz2
"""

from __future__ import annotations

import bz2
import json
import sys
from pathlib import Path

from lm_eval.tasks.hellaswag.utils import preprocess


def build(source: Path, out: Path, test: int = 500, train: int = 100) -> None:
    lines = bz2.decompress(source.read_bytes()).decode("utf-8").split("\n")
    with out.open("w") as f:
        for i in range(test + train):
            query, label, *endings = lines[6 * i:6 * i + 6]
            doc = {"split": "test" if i < test else "train", "query": preprocess(query),
                   "choices": [preprocess(e) for e in endings], "label": int(label)}
            f.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(__file__).with_name("hellaswag.jsonl"))

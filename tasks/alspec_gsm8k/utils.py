"""The GSM8K test split from the bundled file (MIT, see gsm8k_LICENSE.txt), for runs without a dataset hub."""

from pathlib import Path

import datasets


def load_gsm8k(**_: object) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("gsm8k_test.jsonl"))})

"""Small real inputs for the training stages: a few documents of the shared policy corpus.

The CSV keeps two exact duplicates and a near-empty notice, so de-duplication runs on real rows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from training import corpus as corpus_stage
from training import policysm as policysm_stage
from training._common import Document, read_corpus

# Rows of Policys_cleaned.csv: 0, 2, 3, 12, 21 are distinct documents; 57 repeats 12 and 65 repeats
# 21 (same text, other citation); 77 is a 102-character notice.
ROWS = [0, 2, 3, 12, 21, 57, 65, 77]
DUPLICATES = 2


@pytest.fixture(scope="session")
def small_csv_facts() -> dict[str, int]:
    return {"rows": len(ROWS), "duplicates": DUPLICATES}


@pytest.fixture(scope="session")
def small_csv(tmp_path_factory, data_dir) -> Path:
    frame = pd.read_csv(data_dir / "policy_corpus" / "Policys_cleaned.csv", dtype=str, keep_default_na=False)
    out = tmp_path_factory.mktemp("policy") / "policy_corpus" / "small.csv"
    out.parent.mkdir()
    frame.iloc[ROWS].to_csv(out, index=False)
    shutil.copyfile(data_dir / "LICENSE-policy-data.txt", out.parent.parent / "LICENSE-policy-data.txt")
    return out


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory, small_csv) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    corpus_stage.main(["--input", str(small_csv), "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def corpus_docs(corpus_dir) -> list[Document]:
    return read_corpus(corpus_dir / "corpus.jsonl")


@pytest.fixture(scope="session")
def policysm_dir(tmp_path_factory, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("policysm")
    policysm_stage.main(["--corpus", str(corpus_dir / "corpus.jsonl"), "--out", str(out), "--seed", "7"])
    return out

"""How many lexicon occurrences each word-matching rule keeps over a model directory's tokens.

    python bench/word_matching.py --model /tmp/e5-small --json bench/results/word_matching_e5.json

PolicyBERT's matching matrix ``M`` maps lexicon words onto tokens. Two rules: **aligned** (the
rule written for one character per token: a word is kept only where it starts and ends on token
boundaries) and **overlap** (a word covers every token it shares a character with; what
``PolicyBertTokenizer.word_spans`` does). Over every document of the shipped corpus, tokenised as
``PolicyBertEmbeddings(long_text="window")`` does (windows of 512 tokens), it counts the
occurrences ``Lexicon.find`` reports, those each rule keeps, those left after the k_w cut
(``PolicyBertTokenizer.word_budget``, the one formula), and for overlap how many characters the
covered tokens hold per character of the word (1.0: the tokens are the word exactly; more: the
word's row of ``M`` also covers its neighbours' characters). The overlap count is checked against
the tokenizer's own ``word_spans``, so the number is the runtime's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import REPO, machine_line

sys.path.insert(0, str(REPO))
from chatchat_policybert.corpus import read_policy_rows
from chatchat_policybert.data import CORPUS_CSV, LEXICON
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer, overlapping_tokens


def aligned_tokens(offsets: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which spans start on a token's first character and end on a token's last one (the rule for one character per
    token)."""
    return np.isin(starts, offsets[:, 0]) & np.isin(ends, offsets[:, 1])


def measure(model: Path, max_length: int) -> dict:
    from transformers import AutoTokenizer

    lexicon = Lexicon.load(LEXICON)
    tokenizer = PolicyBertTokenizer(AutoTokenizer.from_pretrained(model, trust_remote_code=False), lexicon)
    texts = [row["contentText"] for row in read_policy_rows(CORPUS_CSV) if row["contentText"]]
    counts = dict(found=0, aligned=0, overlap=0, aligned_after_kw=0, overlap_after_kw=0, windows=0, tokens=0)
    covered_chars = word_chars = 0
    for text in texts:
        encoding = tokenizer.encode([text], max_length=max_length)[0]
        for window in [encoding, *encoding.overflowing]:
            counts["windows"] += 1
            real = sum(window.attention_mask)
            counts["tokens"] += real
            offsets = np.array(window.offsets, dtype=np.int64).reshape(-1, 2)
            tokens = np.flatnonzero(np.array([s == 0 for s in window.sequence_ids]) & (offsets[:, 1] > offsets[:, 0]))
            low, high = int(offsets[tokens, 0].min()), int(offsets[tokens, 1].max())
            found = lexicon.find(text[low:high])
            own = offsets[tokens] - low
            first, last = overlapping_tokens(own, found[:, 1], found[:, 2])
            overlap = first < last
            aligned = aligned_tokens(own, found[:, 1], found[:, 2])
            budget = tokenizer.word_budget(real)
            counts["found"] += len(found)
            counts["aligned"] += int(aligned.sum())
            counts["overlap"] += int(overlap.sum())
            counts["aligned_after_kw"] += min(budget, int(aligned.sum()))
            counts["overlap_after_kw"] += min(budget, int(overlap.sum()))
            spans = tokenizer.word_spans(window, (text,))
            assert len(spans) == int(overlap.sum()), "the tokenizer's word_spans disagree with the overlap rule"
            for f, la, (_, start, end) in zip(first[overlap], last[overlap], found[overlap]):
                covered_chars += int(own[la - 1, 1] - own[f, 0])
                word_chars += int(end - start)
    return {
        "model": str(model),
        "documents": len(texts),
        **counts,
        "overlap_chars_per_word_char": covered_chars / max(word_chars, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a model directory (its tokenizer is used)")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per window")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = measure(args.model, args.max_length)
    result["machine"] = machine_line("cpu", 1)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["command"] = "python bench/word_matching.py " + " ".join(argv if argv is not None else sys.argv[1:])
    found = result["found"]
    for rule in ("aligned", "overlap"):
        print(
            f"{rule:8s} keeps {result[rule]:7d} of {found} occurrences ({result[rule] / found:.1%}); "
            f"after the k_w cut {result[f'{rule}_after_kw']:7d}"
        )
    print(f"overlap: covered tokens hold {result['overlap_chars_per_word_char']:.3f} characters per word character")
    print(
        f"{result['documents']} documents, {result['windows']} windows, {result['tokens']} tokens; {result['machine']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

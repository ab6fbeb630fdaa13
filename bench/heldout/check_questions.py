"""Checks a held-out question file against the rules in bench/heldout/README.md before the file is first used.

Loads the file with the project's own reader (``load_questions``: evidence is a verbatim substring of its document,
ids are unique, every ``doc_title`` resolves to one document of the knowledge base), then checks what the reader does
not: one question per document, question and evidence lengths, evidence found in no other document (else two
documents answer it), and that questions are paraphrased. For that it reports the longest run of characters each
question shares with its document (title or text); a run of 4 or more Chinese characters (numbers, Latin letters and
punctuation break a run) is a problem unless it lies in a proper name passed with ``--allow``. With ``--existing`` it
also reports whether an evidence span overlaps an earlier set's evidence in the same document (the same fact asked
again) and how many documents no earlier set covers.

It reads files only; it runs no retrieval, embedding or evaluation. Exit status 1 when any problem is found.

    python bench/heldout/check_questions.py bench/heldout/new_questions_2026-11-26.jsonl \
        --existing chatchat_policybert/data/policy_questions.jsonl bench/heldout/paraphrased_questions.jsonl \
        --allow 数字中国 数字经济 中国互联网发展报告 产品主数据 十五运会 中国数据分析行业人才指数报告
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chatchat_policybert.data import CORPUS_CSV
from chatchat_policybert.evaluation.dataset import EvalDocument, load_corpus, load_questions

MIN_RUN = 4
QUESTION_CHARS = (8, 40)
EVIDENCE_CHARS = (15, 80)
CJK_RUN = re.compile(r"[\u3400-\u9fff]+")


def shared_runs(question: str, document: str) -> list[str]:
    """Maximal runs of ``question`` that occur verbatim in ``document``, longest first."""
    runs: list[str] = []
    for start in range(len(question)):
        length = 0
        while start + length < len(question) and question[start : start + length + 1] in document:
            length += 1
        run = question[start : start + length]
        if run and not any(run in other for other in runs):
            runs.append(run)
    return sorted(runs, key=len, reverse=True)


def copied_words(run: str, allowed: list[str]) -> int:
    """Length of the longest run of Chinese characters left once allowed names are taken out.

    Numbers, years, Latin names and punctuation do not count as copied wording: they break a run.
    """
    if any(run in name for name in allowed):
        return 0
    for name in sorted(allowed, key=len, reverse=True):
        run = run.replace(name, " ")
    return max((len(m) for m in CJK_RUN.findall(run)), default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("questions", type=Path)
    parser.add_argument("--corpus", type=Path, default=CORPUS_CSV)
    parser.add_argument("--existing", type=Path, nargs="*", default=[], help="earlier question files")
    parser.add_argument("--allow", nargs="*", default=[], help="proper names a question may copy")
    parser.add_argument(
        "--per-document",
        type=int,
        default=1,
        help="questions allowed on one document (1 for a confirmation set; a training set asks several); questions "
        "on one document must still ask different facts (evidence spans may not overlap)",
    )
    args = parser.parse_args(argv)

    corpus = load_corpus(args.corpus)
    queries = load_questions(args.questions, corpus)
    rows = [json.loads(line) for line in args.questions.read_text(encoding="utf-8").splitlines() if line.strip()]
    doc_of_group: dict[str, EvalDocument] = {}
    for doc in corpus.documents:
        doc_of_group.setdefault(doc.group, doc)
    earlier: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for path in args.existing:
        for query in load_questions(path, corpus):
            for group in query.gains:
                earlier[group].append((query.qid, query.evidence or ""))

    asked: dict[str, list[tuple[str, str]]] = defaultdict(list)
    problems: list[str] = []
    per_doc: dict[str, list[str]] = defaultdict(list)
    longest: list[int] = []
    print(f"{'id':6} {'q':>3} {'ev':>3} longest shared run")
    for row, query in zip(rows, queries, strict=True):
        (group,) = query.gains
        doc = doc_of_group[group]
        per_doc[group].append(query.qid)
        question, evidence = row["question"], row["evidence"]
        runs = shared_runs(question, doc.title + "\n" + doc.text)
        top = runs[0] if runs else ""
        longest.append(len(top))
        print(f"{query.qid:6} {len(question):3} {len(evidence):3} {top!r}")
        if not QUESTION_CHARS[0] <= len(question) <= QUESTION_CHARS[1]:
            problems.append(f"{query.qid}: question has {len(question)} characters, expected {QUESTION_CHARS}")
        if not EVIDENCE_CHARS[0] <= len(evidence) <= EVIDENCE_CHARS[1]:
            problems.append(f"{query.qid}: evidence has {len(evidence)} characters, expected {EVIDENCE_CHARS}")
        copied = [run for run in runs if copied_words(run, args.allow) >= MIN_RUN]
        if copied:
            problems.append(f"{query.qid}: copies {copied} from its document")
        elsewhere = {d.group for d in corpus.documents if d.group != group and evidence in d.text}
        if elsewhere:
            problems.append(f"{query.qid}: evidence also occurs in {len(elsewhere)} other document(s): not one answer")
        start = doc.text.find(evidence)
        span = range(start, start + len(evidence))
        for qid, other in [*earlier.get(group, []), *asked[group]]:
            other_start = doc.text.find(other)
            if other_start >= 0 and range(max(span.start, other_start), min(span.stop, other_start + len(other))):
                problems.append(f"{query.qid}: evidence overlaps {qid}'s evidence (the same fact)")
        asked[group].append((query.qid, evidence))  # a later question of this file on the same document too
    for group, qids in per_doc.items():
        if len(qids) > args.per_document:
            problems.append(
                f"{', '.join(qids)}: {len(qids)} questions on {doc_of_group[group].title!r}, "
                f"expected at most {args.per_document}"
            )

    kb_groups = set(corpus.kb_files.values())
    fresh = [g for g in per_doc if g not in earlier]
    print(f"\n{len(queries)} questions, {len(per_doc)} documents of the {len(kb_groups)} the knowledge base holds")
    if args.existing:
        never = sorted(g for g in kb_groups if g not in earlier)
        print(f"{len(fresh)} documents no earlier set asks about ({len(never)} such documents in the knowledge base)")
    print(
        f"longest shared run per question: max {max(longest)}, "
        + ", ".join(f"{n}: {longest.count(n)}" for n in sorted(set(longest)))
    )
    for problem in problems:
        print(f"PROBLEM {problem}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

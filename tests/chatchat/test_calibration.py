"""The calibrated FAISS ensemble on a real root: `chatchat init` → `setup` → `kb -r` (tiny random PolicyBERT, 6
documents),
dev pairs from `training.pairs` on that root, then `chatchat-policybert setup --calibrate`.

What is proved: the fusion the calibration scores is what Chatchat's `search_docs` returns under the
plugin's hook at every weight and threshold; the calibrated setting is never below BM25 alone or
the vectors alone on the questions it was chosen on, and `search_docs` after `setup --calibrate`
scores exactly what the calibration reported; `doctor` shows the weights, the threshold and the
dev metrics; a stale index or a wrong file is one error line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from chatchat_deploy import BIN, run, set_analyzer

from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.deploy.calibration import (
    COSINE_CUTS,
    LOOSEST,
    NO_VECTORS,
    QUANTILES,
    Candidates,
    Setting,
    calibrate_root,
    fuse,
    threshold_grid,
    write_calibration,
)
from chatchat_policybert.deploy.questions import dev_queries
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.evaluation.dataset import load_corpus, load_questions
from chatchat_policybert.evaluation.knowledge_base import load_chunks, prepare_root
from chatchat_policybert.evaluation.retrievers import Bm25, ChatchatEnsemble, ChatchatSearch
from chatchat_policybert.evaluation.scoring import evaluate_retriever
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION
from chatchat_policybert.retrieval.analyzer import ANALYZERS, get_analyzer
from chatchat_policybert.retrieval.bm25_index import BM25_FILE, saved_summary
from chatchat_policybert.retrieval.hybrid import HybridConfig, configured_analyzer, configured_hybrid, parse_hybrid
from chatchat_policybert.stores import get_store
from chatchat_policybert.stores.faiss_store import faiss_indexes
from tests.support.fast_loop import slow_fixture
from tests.support.tiny_models import build_tiny_policybert
from training import pairs

N_DOCUMENTS = 6
MAX_CHARS = 1200


def write_folder(folder: Path, documents: list) -> Path:
    folder.mkdir(parents=True)
    for i, doc in enumerate(documents):
        (folder / f"policy{i}.md").write_text(doc.content[:MAX_CHARS], encoding="utf-8")
    return folder


def build_root(tmp: Path, policy_documents: list, reference_lexicon) -> tuple[Path, str, Path]:
    """(root, kb, model): `chatchat init` → `setup` → `kb -r` of the first documents with a perturbed random tiny
    PolicyBERT."""
    documents = policy_documents[:N_DOCUMENTS]
    corpus = load_corpus(write_folder(tmp / "docs", documents))
    texts = [d.content[:MAX_CHARS] for d in documents] + [DEFAULT_QUERY_INSTRUCTION]
    model = build_tiny_policybert(tmp / "model", texts, reference_lexicon, perturb=True)
    root = tmp / "root"
    return root, prepare_root(root, corpus, model, build_index=True), model


@slow_fixture(scope="module")
def calibrated_root(tmp_path_factory, policy_documents, reference_lexicon):
    """(root, kb, model, dev.jsonl): a built root and training.pairs' dev split of its KB (half the documents)."""
    tmp = tmp_path_factory.mktemp("calibration")
    root, kb, model = build_root(tmp, policy_documents, reference_lexicon)
    pairs.main(
        [
            "--chatchat-root",
            str(root),
            "--out",
            str(tmp / "pairs"),
            "--dev-ratio",
            "0.5",
            "--negatives",
            "3",
            "--ict-per-chunk",
            "3",
        ]
    )
    return root, kb, model, tmp / "pairs" / "dev.jsonl"


def set_hybrid(root: Path, bm25_weight: float, dense_weight: float) -> None:
    path = root / "model_settings.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    platform = next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)
    platform["hybrid"] = {**(platform.get("hybrid") or {}), "bm25_weight": bm25_weight, "dense_weight": dense_weight}
    path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")


def test_the_fusion_scored_is_what_search_docs_returns(calibrated_root):
    root, kb, _, dev = calibrated_root
    queries, chunks, _ = dev_queries(dev, root, kb)
    texts = [q.text for q in queries[:8]]
    with Candidates(root, kb, chunks, root / "logs" / "candidates.log") as candidates:
        lists = {text: candidates.get(text) for text in texts}
        top_k = candidates.top_k
    compared = 0
    for weights in ((0.5, 0.5), (0.2, 0.8)):
        set_hybrid(root, *weights)
        with ChatchatSearch(root, kb, chunks, top_k, root / "logs" / "search.log") as search:
            for threshold in (0.0, 0.2929, 0.6, 2.0):
                for text in texts:
                    expected = fuse(*lists[text], chunks, Setting(*weights, threshold), top_k)
                    assert search.search(text, threshold)[0] == expected, (weights, threshold, text)
                    compared += 1
    assert compared == 2 * 4 * len(texts) and len(texts) == 8


def test_calibration_is_never_below_either_half_and_is_what_the_rag_path_then_scores(calibrated_root):
    root, kb, _, dev = calibrated_root
    calibration = calibrate_root(root, kb, dev, root / "logs")
    mrr = {name: row.metrics["MRR@10"] for name, row in calibration.rows.items()}
    assert mrr["calibrated"] >= max(mrr["bm25"], mrr["dense"])
    assert mrr["calibrated"] >= mrr["hybrid 0.5"]
    assert calibration.questions == len(dev.read_text(encoding="utf-8").splitlines())

    write_calibration(root, calibration)
    platform = next(
        p
        for p in yaml.safe_load((root / "model_settings.yaml").read_text(encoding="utf-8"))["MODEL_PLATFORMS"]
        if "local_embeddings" in p
    )
    hybrid = parse_hybrid(platform)
    assert (hybrid.bm25_weight, hybrid.dense_weight, hybrid.score_threshold) == (
        calibration.chosen.bm25_weight,
        calibration.chosen.dense_weight,
        calibration.chosen.threshold,
    )
    assert hybrid.calibration["metrics"]["calibrated"]["MRR@10"] == round(mrr["calibrated"], 4)
    assert (
        yaml.safe_load((root / "kb_settings.yaml").read_text(encoding="utf-8"))["SCORE_THRESHOLD"]
        == calibration.chosen.threshold
    )
    # Chatchat's own search_docs at the recorded settings (threshold: the one it now passes by default).
    queries, chunks, _ = dev_queries(dev, root, kb)
    with ChatchatSearch(root, kb, chunks, calibration.top_k, root / "logs" / "search.log") as search:
        deployed = evaluate_retriever(ChatchatEnsemble(search, None), queries, chunks, [1, 5, 10])
    assert deployed.metrics["MRR@10"] == pytest.approx(mrr["calibrated"], abs=1e-12)


def test_setup_calibrate_records_the_choice_and_doctor_shows_it(calibrated_root, tmp_path, tiny_model_dir):
    root, _, model, dev = calibrated_root
    env = dict(os.environ)

    def cli(*args: str):
        return run([str(BIN / "chatchat-policybert"), *args, "--root", str(root)], env, timeout=600)

    missing = cli("setup", "--model", str(model), "--calibrate", str(tmp_path / "nope.jsonl"), "--no-check")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: question file {tmp_path / 'nope.jsonl'}: not found"
    ]
    gbk = tmp_path / "gbk.jsonl"  # a question file saved as GBK: one line, before the root's settings change
    gbk.write_bytes(dev.read_text(encoding="utf-8").encode("gbk", errors="replace"))
    kept = {name: (root / name).read_bytes() for name in ("model_settings.yaml", "kb_settings.yaml")}
    encoded = cli("setup", "--model", str(model), "--calibrate", str(gbk), "--no-check")
    assert encoded.returncode == 2 and "Traceback" not in encoded.stderr, encoded.stderr
    line = encoded.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {gbk}: not UTF-8 text") and "iconv -f GBK -t UTF-8" in line, line
    assert {name: (root / name).read_bytes() for name in kept} == kept
    other = cli("setup", "--model", str(tiny_model_dir("attn", seed=5)), "--calibrate", str(dev), "--no-check")
    assert other.returncode == 2, other.stdout + other.stderr
    assert "not made by the configured model" in other.stderr and other.stderr.count("\n") == 1

    done = cli("setup", "--model", str(model), "--calibrate", str(dev))
    assert "| calibrated |" in done.stdout and "OK    calibrated the FAISS ensemble" in done.stdout, (
        done.stdout + done.stderr
    )
    doctor = cli("doctor", "--no-load")
    lines = doctor.stdout.splitlines()
    weights = next(line for line in lines if "FAISS ensemble: weights BM25" in line)
    assert weights.startswith("OK")
    assert any(line.startswith("OK") and f"of {dev.resolve()}" in line and "MRR@10 bm25" in line for line in lines)


def test_doctor_warns_when_the_threshold_moved_and_names_a_broken_block():
    assert parse_hybrid({"platform_name": "p"}) is None
    with pytest.raises(SettingsError, match=r"platform 'p': invalid 'hybrid' \(dense_weight: .*above 0"):
        parse_hybrid({"platform_name": "p", "hybrid": {"bm25_weight": 0, "dense_weight": 0}})
    with pytest.raises(SettingsError, match=r"platform 'p': invalid 'hybrid' \(colour: Extra inputs"):
        parse_hybrid({"platform_name": "p", "hybrid": {"colour": 1}})
    from chatchat_policybert.configure.doctor import describe

    hybrid = HybridConfig(bm25_weight=0.7, dense_weight=0.3, score_threshold=0.5)
    assert [level for level, _ in describe(hybrid, 0.5)] == ["OK"]
    assert [level for level, _ in describe(hybrid, 0.2929)] == ["OK", "WARN"]
    assert "Chatchat's weights BM25 0.5 / dense 0.5, not calibrated" in describe(None, 0.2929)[0][1]


def test_the_threshold_grid_follows_the_models_own_cosines():
    """e5's cosines sit in a narrow band: the fixed cuts put one or two thresholds there, the model's quantiles one
    per decile, each letting through the share of the vector lists' hits it names."""
    store = get_store("faiss")
    cosines = np.random.default_rng(0).uniform(0.72, 0.91, size=490)  # 49 questions x top_k 10
    relevances = [store.score_threshold_for(float(c)) for c in cosines]
    low, high = min(relevances), max(relevances)
    fixed = threshold_grid(0.293, "faiss")
    grid = threshold_grid(0.293, "faiss", relevances)
    assert len(fixed) == len(COSINE_CUTS) + 3 and fixed[:2] == [0.293, LOOSEST] and fixed[-1] == NO_VECTORS
    assert grid[: len(fixed) - 1] == fixed[:-1] and grid[-1] == NO_VECTORS, "the fixed points stay, in order"
    assert len([t for t in fixed if low <= t <= high]) <= 2
    inside = [t for t in grid if low <= t <= high and t not in fixed]
    assert len(inside) == len(QUANTILES)
    for q, threshold in zip(QUANTILES, inside):
        passing = np.mean(np.asarray(relevances) >= threshold)
        assert abs(passing - (1 - q)) <= 0.01, (q, threshold, passing)
    # Relevances a store's API would refuse as a threshold (cosines under FAISS's loosest) add nothing.
    assert threshold_grid(0.293, "faiss", [-0.5, -0.4, -0.3]) == fixed


def test_labelled_questions_in_the_evaluation_format_calibrate_too(calibrated_root, tmp_path):
    import json

    root, kb, _, _ = calibrated_root
    lines = []
    for i in range(N_DOCUMENTS):
        text = (content_dir(root, kb) / f"policy{i}.md").read_text(encoding="utf-8")
        lines.append({"id": f"q{i}", "question": text[40:70], "doc_title": f"policy{i}", "evidence": text[40:90]})
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    queries, chunks, _ = dev_queries(questions, root, kb)
    assert [q.qid for q in queries] == [f"q{i}" for i in range(N_DOCUMENTS)]
    assert all(len(q.gains) == 1 for q in queries) and {c.source for c in chunks} == {
        f"policy{i}.md" for i in range(N_DOCUMENTS)
    }
    saved = faiss_indexes(root, kb)[0].parent / BM25_FILE
    built_by = saved_summary(saved)[0]
    calibration = calibrate_root(root, kb, questions, tmp_path)
    mrr = {name: row.metrics["MRR@10"] for name, row in calibration.rows.items()}
    assert calibration.questions == N_DOCUMENTS and mrr["calibrated"] >= max(
        mrr["bm25"], mrr["dense"], mrr["hybrid 0.5"]
    )
    # Labelled questions compared every analyzer; the index saved beside the vectors is still the configured one's.
    assert set(calibration.analyzers) == set(ANALYZERS)
    assert saved_summary(saved)[0] == built_by == configured_analyzer(root).identity

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"query": 1}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"wrong.jsonl: expected dev pairs"):
        dev_queries(wrong, root, kb)


def test_setup_and_doctor_show_the_analyzer_and_an_index_another_analyzer_built(calibrated_root, tmp_path):
    root, kb, model, _ = calibrated_root
    original = (root / "model_settings.yaml").read_bytes()
    env = dict(os.environ)

    def doctor() -> list[str]:
        return run(
            [str(BIN / "chatchat-policybert"), "doctor", "--no-load", "--root", str(root)], env
        ).stdout.splitlines()

    try:
        lines = doctor()  # the root as setup made it: policy, and `kb -r` saved its index with it
        assert any(line.startswith("OK    BM25 analyzer policy: policy v1 ") for line in lines), lines
        assert any(line.startswith("OK    saved BM25 index ") and "analyzer 'policy v1" in line for line in lines)
        saved = faiss_indexes(root, kb)[0].parent / BM25_FILE
        kept = saved.read_bytes()
        saved.unlink()
        os.mkfifo(saved)  # a reader that opened it would wait forever
        try:
            lines = doctor()
        finally:
            saved.unlink()
            saved.write_bytes(kept)
        assert any(
            line.startswith(f"WARN  saved BM25 index {saved} is not used (") and "a FIFO" in line for line in lines
        ), [line for line in lines if "BM25" in line]
        set_analyzer(root, None)  # an upgraded deployment: no `analyzer:` in its hybrid block
        lines = doctor()
        assert any(line.startswith("OK    BM25 analyzer chatchat (the hybrid block has no") for line in lines), lines
        assert any(
            line.startswith("WARN  saved BM25 index ") and "built by analyzer 'policy v1" in line for line in lines
        ), [line for line in lines if "BM25" in line]
        set_analyzer(root, "policy")
        (root / "stop.txt").write_bytes("的\n".encode("utf-16"))
        settings = yaml.safe_load((root / "model_settings.yaml").read_text(encoding="utf-8"))
        next(p for p in settings["MODEL_PLATFORMS"] if "local_embeddings" in p)["hybrid"]["analyzer_stopwords"] = (
            "stop.txt"
        )
        (root / "model_settings.yaml").write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")
        lines = doctor()
        assert any(
            line.startswith(f"ERROR BM25 analyzer policy: stopword file {root / 'stop.txt'}: not UTF-8")
            for line in lines
        ), lines
    finally:
        (root / "model_settings.yaml").write_bytes(original)
    shown = run(
        [
            str(BIN / "chatchat-policybert"),
            "setup",
            "--root",
            str(root),
            "--model",
            str(model),
            "--analyzer",
            "chatchat",
            "--no-check",
        ],
        env,
    )
    try:
        assert shown.returncode == 0, shown.stderr
        assert "OK    BM25 analyzer chatchat (jieba " in shown.stdout
        assert f"NOTE  the BM25 index of {kb} (policybert) was built by policy v1 " in shown.stdout
        assert f"run `chatchat kb -r -n {kb}`" in shown.stdout
    finally:
        (root / "model_settings.yaml").write_bytes(original)


def test_labelled_questions_choose_the_analyzer_that_clearly_wins(calibrated_root, tmp_path):
    """Questions of two-character pieces of one document (the pieces a paraphrase shares): the policy analyzer's
    bigrams match them where jieba's words often do not. The root is configured for chatchat; calibration on the
    labelled questions must pick policy, and record it."""
    import json

    root, kb, _, _ = calibrated_root
    original = (root / "model_settings.yaml").read_bytes()
    corpus = load_corpus(content_dir(root, kb))
    lines = []
    for i in range(N_DOCUMENTS):
        text = (content_dir(root, kb) / f"policy{i}.md").read_text(encoding="utf-8")
        runs = [r for r in re.findall(r"[\u4e00-\u9fff]{5,}", text[100:])][:6]
        pieces = "，".join(r[1:3] for r in runs)
        lines.append({"id": f"b{i}", "question": pieces, "doc_title": f"policy{i}", "evidence": runs[0]})
    questions = tmp_path / "bigram_questions.jsonl"
    questions.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    queries = load_questions(questions, corpus)
    chunks = load_chunks(root, kb, corpus)
    reference = {
        name: evaluate_retriever(Bm25(chunks, 10, get_analyzer(name)), queries, chunks, [1, 5, 10]).metrics["MRR@10"]
        for name in ANALYZERS
    }
    assert reference["policy"] >= reference["chatchat"] + 0.2, reference  # a KB where policy clearly wins
    try:
        set_analyzer(root, "chatchat")
        calibration = calibrate_root(root, kb, questions, tmp_path)
        assert calibration.analyzer == "policy" and set(calibration.analyzers) == set(ANALYZERS)
        assert calibration.analyzers["policy"] > calibration.analyzers["chatchat"]
        write_calibration(root, calibration)
        assert configured_hybrid(root).analyzer == "policy"
        assert configured_hybrid(root).calibration["analyzers"] == calibration.analyzers
    finally:
        (root / "model_settings.yaml").write_bytes(original)


def test_a_refused_setup_calibrate_leaves_the_root_as_it_was(calibrated_root, tmp_path, tiny_model_dir):
    """Issue 43 item 3: `setup --model M --calibrate q.jsonl --corpus CSV` dropped the calibrated hybrid and reset
    VECTOR_SEARCH_TOP_K 10 -> 5, then exited 2, for each input below. Now every input is checked before the first write
    (the questions against the KB, --corpus against the KB's files), and what only the calibration's worker can tell
    (an index another model built) puts the three files back: byte for byte as they were, each time."""
    import json

    from chatchat_policybert.chatchat.config import SettingsDocs
    from chatchat_policybert.data import CORPUS_CSV, DATA_DIR
    from chatchat_policybert.deploy.calibration import update_settings

    root, kb, model, dev = calibrated_root
    names = ("model_settings.yaml", "kb_settings.yaml", "basic_settings.yaml")
    original = {name: (root / name).read_bytes() for name in names}

    def questions(name: str, **change: str) -> Path:
        lines = []
        for i in range(N_DOCUMENTS):
            text = (content_dir(root, kb) / f"policy{i}.md").read_text(encoding="utf-8")
            line = {"id": f"q{i}", "question": text[40:70], "doc_title": f"policy{i}", "evidence": text[40:90]}
            lines.append({**line, **(change if i == 2 else {})})
        path = tmp_path / name
        path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        return path

    good = questions("good.jsonl")
    cases = {
        "doc_title not in the KB": ["--calibrate", str(questions("title.jsonl", doc_title="policy99"))],
        "an empty question": ["--calibrate", str(questions("empty.jsonl", question=""))],
        "another KB's corpus": ["--calibrate", str(good), "--corpus", str(CORPUS_CSV)],
        "a missing corpus": ["--calibrate", str(good), "--corpus", str(tmp_path / "missing.csv")],
        "the shipped questions, no corpus": ["--calibrate", str(DATA_DIR / "policy_questions.jsonl")],
        "an index another model built": ["--calibrate", str(dev)],
    }
    other_model = tiny_model_dir("attn", seed=5)
    try:  # a working root that differs from what setup writes: a calibrated hybrid, VECTOR_SEARCH_TOP_K 10
        calibrated = HybridConfig(bm25_weight=0.3, dense_weight=0.7, score_threshold=0.6, analyzer="policy")
        update_settings(root, hybrid=calibrated, threshold=0.6)
        docs = SettingsDocs(root)
        docs.kb["VECTOR_SEARCH_TOP_K"] = 10
        docs.write()
        before = {name: (root / name).read_bytes() for name in names}
        for case, flags in cases.items():
            used = other_model if case == "an index another model built" else model
            result = run(
                [
                    str(BIN / "chatchat-policybert"),
                    "setup",
                    "--root",
                    str(root),
                    "--model",
                    str(used),
                    *flags,
                    "--no-check",
                ],
                dict(os.environ),
                timeout=600,
            )
            assert result.returncode == 2, (case, result.stdout, result.stderr)
            assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, (case, result.stderr)
            assert {name: (root / name).read_bytes() for name in names} == before, case
    finally:
        for name, content in original.items():
            (root / name).write_bytes(content)

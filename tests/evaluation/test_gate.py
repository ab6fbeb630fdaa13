"""Issue #12 §4, the gate: ``eval --baseline DIR [--require-better]`` against a real Chatchat root.

The root is built once per module without an index (dense retrieval embeds the chunks itself),
so this module costs about one ``chatchat init`` plus a few tiny-model embeddings.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from chatchat_policybert.errors import run_cli
from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.evaluation.evaluate import main
from chatchat_policybert.evaluation.gate_rule import EXIT_WORSE, gate_failure
from chatchat_policybert.evaluation.knowledge_base import prepare_root
from chatchat_policybert.evaluation.metrics import paired_bootstrap_interval
from chatchat_policybert.evaluation.scoring import Delta
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION
from tests.support.fast_loop import slow_fixture
from tests.support.tiny_models import build_tiny_bert, build_tiny_policybert

from .test_eval_data import write_csv, write_jsonl

N_DOCUMENTS = 6
MAX_CHARS = 600


def test_paired_bootstrap_interval():
    assert paired_bootstrap_interval([0.5, 1.0, 0.0], [0.5, 1.0, 0.0]) == (0.0, 0.0)
    assert paired_bootstrap_interval([0.7, 0.3, 0.9], [0.5, 0.1, 0.7]) == pytest.approx((0.2, 0.2))
    rng = np.random.default_rng(1)
    baseline = rng.uniform(size=200)
    better = baseline + rng.normal(0.05, 0.05, size=200)
    low, high = paired_bootstrap_interval(better, baseline)
    assert 0 < low < 0.05 < high < 0.1, "the interval holds the true mean shift, paired variation only"
    assert paired_bootstrap_interval(better, baseline) == (low, high), "fixed seed: the same decision every run"
    assert paired_bootstrap_interval(better, baseline, seed=2) != (low, high)


def test_weighted_paired_bootstrap_interval_is_of_the_weighted_mean_and_unit_weights_change_nothing():
    """``tune --feedback-propensity``: marks seen where few users look weigh more. As in issue 49's replay of user b,
    most marks confirm the top hit (a tower can only lose there, a little) and few are below it (a large gain): the
    plain mean is about 0, the weighted one (weight 4 below the top) is above 0 beyond noise."""
    rng = np.random.default_rng(3)
    confirmed, below = 160, 40
    baseline = np.concatenate([np.full(confirmed, 1.0), np.full(below, 0.4)])
    candidate = baseline + np.concatenate([rng.normal(-0.05, 0.1, confirmed), rng.normal(0.2, 0.1, below)])
    weights = np.concatenate([np.ones(confirmed), np.full(below, 4.0)])
    ones = paired_bootstrap_interval(candidate, baseline, weights=np.ones(confirmed + below))
    assert ones == paired_bootstrap_interval(candidate, baseline)
    low, high = paired_bootstrap_interval(candidate, baseline)
    assert low < 0 < high
    weighted = np.average(candidate - baseline, weights=weights)
    w_low, w_high = paired_bootstrap_interval(candidate, baseline, weights=weights)
    assert 0 < w_low < weighted < w_high
    for bad in ([1.0] * 3, [0.0] * (confirmed + below)):
        with pytest.raises(ValueError, match="expected a positive weight per question"):
            paired_bootstrap_interval(candidate, baseline, weights=bad)
    with pytest.raises(ValueError, match="same, non-zero number"):
        paired_bootstrap_interval([1.0], [1.0, 0.0])


def test_the_gate_rule_a_tie_passes_unless_a_rise_is_asked():
    """`eval --require-better` lets an equal MRR@10 pass; `training.ablate_retrieval` asks a rise on the dev pairs."""

    def mrr(candidate: float, baseline: float) -> list[Delta]:
        delta = candidate - baseline
        return [Delta("R@1", 1.0, 0.0, 1.0, 1.0), Delta("MRR@10", candidate, baseline, delta - 0.1, delta + 0.1)]

    assert gate_failure(mrr(0.5, 0.5)) is None and gate_failure(mrr(0.75, 0.5), must_rise=True) is None
    assert gate_failure(mrr(0.5, 0.5), must_rise=True, baseline="the deployed") == (
        "candidate MRR@10 0.5000 is not above the deployed 0.5000 (delta +0.0000, 95% CI [-0.1000, +0.1000])"
    )
    assert gate_failure(mrr(0.25, 0.5)) == (
        "candidate MRR@10 0.2500 is below the baseline's 0.5000 (delta -0.2500, 95% CI [-0.3500, -0.1500])"
    )


@slow_fixture(scope="module")
def setup(tmp_path_factory, policy_documents, reference_lexicon):
    """(root, corpus CSV, questions JSONL, PolicyBERT dir, BERT dir): two random models that rank differently."""
    tmp = tmp_path_factory.mktemp("gate")
    rows = [(d.title, d.content[:MAX_CHARS]) for d in policy_documents[:N_DOCUMENTS]]
    corpus_csv = write_csv(tmp / "policies.csv", rows)
    corpus = load_corpus(corpus_csv)
    docs = [d for d in corpus.documents if d.group in set(corpus.kb_files.values())]
    questions = write_jsonl(
        tmp / "q.jsonl",
        [
            {"id": f"q{i}", "question": doc.text[100:130], "doc_title": doc.title, "evidence": doc.text[100:160]}
            for i, doc in enumerate(docs)
        ],
    )
    texts = [text for _, text in rows] + [DEFAULT_QUERY_INSTRUCTION]
    candidate = build_tiny_policybert(tmp / "candidate", texts, reference_lexicon, perturb=True)
    baseline = build_tiny_bert(tmp / "baseline", texts, seed=5, perturb=True)
    root = tmp / "root"
    prepare_root(root, corpus, None, build_index=False)
    return root, corpus_csv, questions, candidate, baseline


def gate(setup, tmp_path, candidate, baseline, *extra: str) -> tuple[int, dict]:
    root, corpus_csv, questions, _, _ = setup
    out = tmp_path / f"{candidate.name}-vs-{baseline.name}.json"
    rc = run_cli(
        main,
        [
            "--corpus",
            str(corpus_csv),
            "--questions",
            str(questions),
            "--chatchat-root",
            str(root),
            "--retrievers",
            "dense",
            "--model",
            str(candidate),
            "--baseline",
            str(baseline),
            "--out",
            str(out),
            *extra,
        ],
    )
    return rc, json.loads(out.read_text(encoding="utf-8"))["gate"]


def test_gate_prints_both_rows_and_paired_deltas(setup, tmp_path, capsys):
    _, _, _, candidate, baseline = setup
    rc, report = gate(setup, tmp_path, candidate, baseline)
    assert rc == 0, "without --require-better the comparison only reports"
    table = capsys.readouterr().out
    assert report["candidate"] == "dense:candidate" and report["baseline"] == "dense:baseline:baseline"
    assert "| metric | dense:candidate | dense:baseline:baseline | delta |" in table
    metrics = [d["metric"] for d in report["deltas"]]
    assert {"R@1", "R@10", "MRR@10", "nDCG@10", "hit@1"} <= set(metrics)
    for delta in report["deltas"]:
        assert delta["delta"] == pytest.approx(delta["candidate"] - delta["baseline"])
        assert delta["low"] <= delta["delta"] <= delta["high"]
        assert f"| {delta['metric']} | {delta['candidate']:.3f} | {delta['baseline']:.3f} |" in table


def test_require_better_fails_exactly_the_worse_model(setup, tmp_path, capsys):
    _, _, _, one, other = setup
    rc_one, report = gate(setup, tmp_path, one, other, "--require-better")
    rc_other, _ = gate(setup, tmp_path, other, one, "--require-better")
    mrr = next(d for d in report["deltas"] if d["metric"] == "MRR@10")
    assert mrr["delta"] != 0, "the two random models must rank differently for this test to mean anything"
    assert sorted([rc_one, rc_other]) == [0, EXIT_WORSE]
    assert (rc_one == EXIT_WORSE) == (mrr["delta"] < 0)
    reasons = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gate: ")]
    assert (
        len(reasons) == 1 and reasons[0].startswith("gate: candidate MRR@10 ") and "below the baseline's" in reasons[0]
    )


def test_a_model_against_itself_passes_with_zero_deltas(setup, tmp_path):
    _, _, _, candidate, _ = setup
    rc, report = gate(setup, tmp_path, candidate, candidate, "--require-better")
    assert rc == 0 and report["failure"] is None
    assert all(d["delta"] == 0 and d["low"] == d["high"] == 0 for d in report["deltas"])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--require-better"], "--require-better needs --baseline"),
        (["--baseline", "{model}"], "--baseline compares dense retrieval"),
        (
            ["--baseline", "{model}", "--model", "{model}", "--retrievers", "bm25"],
            "--baseline compares dense retrieval",
        ),
        (["--baseline", "{model}/missing", "--model", "{model}"], "--baseline {model}/missing: not a model directory"),
    ],
)
def test_gate_flag_errors_are_one_line(setup, capsys, args, expected):
    _, _, _, candidate, _ = setup
    rc = run_cli(main, [a.format(model=candidate) for a in args])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and expected.format(model=candidate) in err, err

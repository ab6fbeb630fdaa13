"""``training.ablate --task retrieval`` end to end at toy size: every arm runs, trains what it says, and is tabled."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.files import write_jsonl
from training import ablate
from training.ablate_retrieval import ARMS

pytestmark = pytest.mark.slow  # every arm is evaluated on a Chatchat root of its own (`chatchat init`)

TOY = [
    "--hidden-size",
    "32",
    "--num-hidden-layers",
    "2",
    "--num-attention-heads",
    "2",
    "--intermediate-size",
    "64",
    "--max-position-embeddings",
    "64",
    "--start-steps",
    "2",
    "--start-batch-size",
    "4",
    "--steps",
    "3",
    "--batch-size",
    "4",
    "--train-group-size",
    "2",
    "--max-length",
    "64",
    "--retrievers",
    "dense",
]


def _char_weights(model_dir):
    """The character encoder's tensors (embeddings and character layers), as safetensors keys without ``bert.``."""
    state = load_file(model_dir / "model.safetensors")
    return {
        k.removeprefix("bert."): v
        for k, v in state.items()
        if k.removeprefix("bert.").startswith(("embeddings.", "encoder.layer."))
    }


def test_every_arm_runs_and_differs_in_what_it_trains(tmp_path, small_csv, reference_lexicon_path):
    corpus = load_corpus(small_csv)
    questions, later = tmp_path / "q.jsonl", tmp_path / "later.jsonl"
    for path, start in ((questions, 100), (later, 160)):
        write_jsonl(
            [
                {
                    "id": f"q{i}",
                    "question": doc.text[start : start + 30],
                    "doc_title": doc.title,
                    "evidence": doc.text[start : start + 60],
                }
                for i, doc in enumerate(corpus.documents)
                if len(doc.text) > 250
            ],
            path,
        )
    out = tmp_path / "ablate"
    argv = [
        "--task",
        "retrieval",
        "--corpus",
        str(small_csv),
        "--lexicon",
        str(reference_lexicon_path),
        "--questions",
        str(questions),
        str(later),
        "--out",
        str(out),
        *TOY,
    ]
    ablate.main([*argv, "--arms", *ARMS, "--seeds", "0"])

    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {(r["arm"], r["seed"]): r for r in results["runs"]}
    assert set(runs) == {(arm, 0) for arm in ARMS}
    table = (out / "results.md").read_text(encoding="utf-8")
    for arm in ARMS:
        assert f"| {arm} |" in table
    assert "| BM25 alone |" in table and (out / "results.png").stat().st_size > 0
    # Each question file is a set of its own, and so are the dev pairs over the chunks (tune's gate's set).
    assert list(results["sets"]) == ["q", "later", "dev pairs"] and "### later" in table
    for rows in results["sets"].values():
        assert "Δdense MRR@10 vs base+ft" in rows["attn"] and "Δdense MRR@10 vs base" in rows["attn"]
        assert "Δdense MRR@10 vs base+ft" not in rows["base+ft"] and "Δdense R@5 vs base" in rows["base+ft"]
    # Every arm (merged, trained, saved) serves with its start's pooling and prompts.
    assert len({tuple(v.values()) for v in results["served_as"].values()}) == 1 and "served as" in table
    # The gate: every trained run against the untuned start, on the dev pairs alone and with the first file.
    assert [(g["arm"], g["seed"]) for g in results["gate"]] == [(arm, 0) for arm in ARMS if arm != "base"]
    assert all({"install on dev pairs alone", "install with q", "Δ later"} <= set(g) for g in results["gate"])
    # Dev is scored per query for every arm (the choice is made there); the verdict names the best fused arm on dev.
    assert all(len(r["dev"]["MRR@10"]) == len(runs["base", 0]["dev"]["MRR@10"]) > 0 for r in runs.values())
    assert all(
        abs(sum(r["dev"]["MRR@10"]) / len(r["dev"]["MRR@10"]) - r["dev"]["mrr@10"]) < 1e-4 for r in runs.values()
    )
    fused = [a for a in ARMS if ARMS[a].fusion]
    best = max(fused, key=lambda a: results["table"][a]["dev MRR@10"][0])
    assert f"verdict: best fused arm on the dev pool is {best} " in table and "Δdev vs base+ft" in table
    # What retrieval sees of the word stream: the served vector moves when the words are let in (s = 1).
    assert runs["base+ft", 0]["vector_change"] is None and runs["attn-open", 0]["vector_change"] > 0

    start = out / "start" / "pretrain" / "final"
    assert json.loads((start / "config.json").read_text())["model_type"] == "bert", "the start is a plain BERT"
    # base+ft: the start's own architecture (no word stream), its character weights trained.
    final = out / "runs" / "base+ft-seed0" / "train" / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "bert"
    assert runs["base+ft", 0]["fusion_scales"] == []
    assert any(not (a == b).all() for a, b in zip(_char_weights(final).values(), _char_weights(start).values()))
    # attn-freeze: the character encoder bit-identical to its merged start; the fusion scales moved.
    merged = out / "runs" / "attn-freeze-seed0" / "merged"
    frozen = out / "runs" / "attn-freeze-seed0" / "train" / "final"
    before, after = _char_weights(merged), _char_weights(frozen)
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
    assert any(s != 0 for s in runs["attn-freeze", 0]["fusion_scales"]), "s starts at 0 (--init bge) and trains"
    # Diagnostics: the word stream's change to the character states (none without a word stream), lexicon coverage.
    assert runs["base+ft", 0]["word_change"] == [] and len(runs["attn-2wl", 0]["word_change"]) == 2
    assert all(change > 0 for change in runs["attn-freeze", 0]["word_change"])
    assert "| --lexicon |" in table and "| KB lexicon |" in table
    kb_words = (out / "kb-lexicon" / "lexicon.txt").read_text(encoding="utf-8").splitlines()
    merged_words = (
        (out / "runs" / "attn-kblex-seed0" / "merged" / "lexicon.txt").read_text(encoding="utf-8").splitlines()
    )
    assert len(merged_words) == len(kb_words), "the KB-lexicon arm's word stream is over the KB's own lexicon"

    # Same budget for every trained arm: the warm-up arm splits its steps, the others run them in one phase.
    def steps(run_dir):
        return json.loads((run_dir / "run.json").read_text())["config"]["max_steps"]

    for arm in ARMS:
        if arm not in ("base", "attn-warm"):
            assert steps(out / "runs" / f"{arm}-seed0" / "train") == 3
    warm = out / "runs" / "attn-warm-seed0"
    assert steps(warm / "warm") + steps(warm / "joint") == 3
    assert json.loads((out / "runs" / "attn-2wl-seed0" / "merged" / "config.json").read_text())["num_word_layers"] == 2
    assert (
        json.loads((out / "runs" / "attn-early-seed0" / "merged" / "config.json").read_text())["late_fusion"] == "none"
    )
    assert (
        json.loads((out / "runs" / "attn-open-seed0" / "merged" / "config.json").read_text())["fusion_scale_init"]
        == 1.0
    )

    # Resumable: a second invocation with another seed runs only what is new; the untrained start has no seed.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/result.json")}
    ablate.main([*argv, "--arms", "base", "base+ft", "attn", "--seeds", "0", "1"])
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    assert sorted(p.parent.name for p in (out / "runs").glob("*-seed1/result.json")) == ["attn-seed1", "base+ft-seed1"]
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    table = results["table"]
    assert [table[arm]["seeds"] for arm in ("base", "base+ft", "attn")] == [1, 2, 2]
    low, high = results["sets"]["later"]["attn"]["Δdense MRR@10 vs base+ft"][1:]
    assert low <= high

    # --table-only tables what finished and starts nothing: seed 2 was never run.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/result.json")}
    ablate.main([*argv, "--arms", "base+ft", "attn", "--seeds", "0", "1", "2", "--table-only"])
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/result.json")} == stamps
    table = json.loads((out / "results.json").read_text(encoding="utf-8"))["table"]
    assert list(table) == ["base+ft", "attn"] and [table[a]["seeds"] for a in table] == [2, 2]

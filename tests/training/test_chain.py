"""The whole chain on real documents into a tiny model: corpus → lexicon → merge → pretrain → PolicySM →
fine-tune → merge back with bge → a loadable retrieval model. Plus every stage's ``--help``."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from chatchat_policybert.errors import InputError, plain_text
from chatchat_policybert.model.loading import load_model_dir, load_policybert
from chatchat_policybert.model.modeling_policybert import PolicyBertForSequenceClassification
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION
from tests.support.outside_chatchat import check_loads_outside_chatchat
from training import build_lexicon, finetune, merge_bge, pretrain
from training.policysm import read_pairs

STAGES = [
    "init_scratch",
    "corpus",
    "build_lexicon",
    "policysm",
    "pretrain",
    "finetune",
    "merge_bge",
    "ablate",
    "pairs",
    "contrastive",
    "export",
]


@pytest.mark.parametrize(
    "stage, argv", [(stage, ["--help"]) for stage in STAGES] + [("ablate", ["--task", "retrieval", "--help"])]
)
def test_every_stage_has_help(stage, argv, capsys, options_without_help):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"training.{stage}").main(argv)
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: python -m training." in text
    assert options_without_help(text) == []
    assert plain_text(text) == text, "no ``code`` or :func:`name` markup"


def test_chain_into_a_merged_model(tmp_path, corpus_dir, policysm_dir, data_dir, tiny_model_dir):
    build_lexicon.main(
        [
            "--corpus",
            str(corpus_dir / "corpus.jsonl"),
            "--out",
            str(tmp_path / "lexicon"),
            "--segmenter",
            "jieba",
            "--stopwords",
            str(data_dir / "lexicon" / "stopword.txt"),
            "--min-count",
            "3",
        ]
    )
    bge = tiny_model_dir(None)  # a miniature bge: plain BERT, same character vocabulary
    assert (
        merge_bge.main(
            [
                "--bge",
                str(bge),
                "--zen",
                "none",
                "--lexicon",
                str(tmp_path / "lexicon" / "lexicon.txt"),
                "--fusion",
                "gate",
                "--num-word-layers",
                "1",
                "--out",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    pretrain.main(
        [
            "--model",
            str(tmp_path / "merged"),
            "--corpus",
            str(corpus_dir / "corpus.jsonl"),
            "--out",
            str(tmp_path / "pre"),
            "--epochs",
            "1",
            "--max-length",
            "32",
            "--device",
            "cpu",
        ]
    )
    finetune.main(
        [
            "--model",
            str(tmp_path / "pre" / "final"),
            "--data",
            str(policysm_dir / "policysm1"),
            "--out",
            str(tmp_path / "ft"),
            "--max-steps",
            "6",
            "--max-length",
            "32",
            "--eval-batch-size",
            "64",
            "--device",
            "cpu",
        ]
    )
    metrics = json.loads((tmp_path / "ft" / "results.json").read_text(encoding="utf-8"))
    assert metrics["examples"]["test"] == sum(
        1 for _ in (policysm_dir / "policysm1" / "test.tsv").open(encoding="utf-8")
    )
    classifier, pair_tokenizer = load_model_dir(tmp_path / "ft" / "final", PolicyBertForSequenceClassification)
    assert classifier.config.fusion_type == "gate" and classifier.config.num_labels == 2
    # The reported accuracies are the saved model's, recounted here from its predictions on the files.
    for split in ("dev", "test"):
        pairs = read_pairs(policysm_dir / "policysm1" / f"{split}.tsv")
        with torch.no_grad():
            predicted = [
                int(label)
                for start in range(0, len(pairs), 64)
                for label in classifier(
                    **pair_tokenizer(
                        [p.a for p in pairs[start : start + 64]],
                        [p.b for p in pairs[start : start + 64]],
                        max_length=32,
                    )
                ).logits.argmax(-1)
            ]
        right = sum(guess == pair.label for guess, pair in zip(predicted, pairs))
        assert metrics[f"{split}_accuracy"] == round(right / len(pairs), 4), split

    assert (
        merge_bge.main(
            [
                "--finetuned",
                str(tmp_path / "ft" / "final"),
                "--alpha",
                "0.5",
                "--bge",
                str(bge),
                "--out",
                str(tmp_path / "export"),
            ]
        )
        == 0
    )
    model, tokenizer = load_policybert(tmp_path / "export")
    with torch.no_grad():
        vectors = model(**tokenizer(["数据要素市场化配置", "个人信息保护"])).pooler_output
    assert vectors.shape == (2, model.config.hidden_size) and torch.isfinite(vectors).all()
    # The fine-tuned word stream made it into the export unchanged.
    assert torch.equal(
        model.word_embeddings.word_embeddings.weight, classifier.bert.word_embeddings.word_embeddings.weight
    )
    # Every stage's directory (its task head included) embeds alike with sentence-transformers and AutoModel.
    for stage in ("pre/final", "ft/final", "export"):
        check_loads_outside_chatchat(tmp_path / stage, query_prompt=DEFAULT_QUERY_INSTRUCTION)


def test_finetune_rejects_corrupt_data(tmp_path, tiny_model_dir):
    for split in ("train", "dev", "test"):
        (tmp_path / f"{split}.tsv").write_text("一句话\t另一句话\t1\t0\n", encoding="utf-8")
    (tmp_path / "dev.tsv").write_text("一句话\t另一句话\tyes\t0\n", encoding="utf-8")
    argv = ["--model", str(tiny_model_dir("none")), "--data", str(tmp_path), "--out", str(tmp_path / "out")]
    with pytest.raises(InputError, match=r"dev\.tsv:1: expected"):
        finetune.main(argv)

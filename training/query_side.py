"""Query-side tuning: train only the encoder that embeds questions (the query tower) against the chunk vectors a
knowledge base already stores, so that nothing is re-embedded (DensePhrases' query-side fine-tuning, Lee et al. 2021).

Why: a retriever deployed over a knowledge base has its chunks embedded once by the document tower. Training both
towers on the KB's own questions needs a ``kb -r`` per candidate and moves the vectors every later document is
compared with; training on sentences cut from the chunks (inverse cloze) lowered the e5 base on paraphrased
questions at every scale tried (docs/training.md). Training the query tower alone on questions like the users'
keeps every stored vector and lifted e5 on question sets it never saw (docs/training.md, "Query-side tuning").

The recipe: a copy of the document tower embeds each question (its query prompt, its pooling:
:func:`~chatchat_policybert.model.embeddings.sentence_vectors`, what it will serve); the loss is a softmax over
**every** stored chunk vector at temperature ``--temperature``, with a positive among the gold document's chunks
(``--positives best``, the default: the one the start model ranks first, so that the tower learns which chunk and
not only which document; ``document``: every chunk of it, -log of their summed probability). The piece-embedding
matrix stays frozen (a KB's questions touch a few hundred of e5's 250 k rows; training it costs memory and moves the
rest by weight decay only). In the plain arm (the default) the word
stream of a PolicyBERT start stays shut: its fusion scales stay 0 and the forward pass skips it; ``--word-stream``
trains it in the query tower (the thesis's fusion under this recipe). Afterwards the trained weights are merged
back toward the document tower, θ = α·θ_trained + (1 − α)·θ_document (``--merge-alpha``), so that a tune always
starts from the model the deployment was set up with and repeated tunes do not drift.

The trained query tower is saved beside the document tower in one directory
(:func:`chatchat_policybert.model.loading.save_query_tower`): ``PolicyBertEmbeddings`` embeds questions with it and
documents with the unchanged document tower.

    python -m training.query_side --model models/policybert --questions q.jsonl --chatchat-root ROOT \\
        --kb WeiMingPolicies --out runs/query_side
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np

from chatchat_policybert.deploy.crossfit import StoredQuestions
from chatchat_policybert.errors import InputError, run_cli
from training.config import Precision, TrainConfig, parse_flags, require_positive, require_share

if TYPE_CHECKING:  # torch and the model load with a run, not with --help
    import torch
    from torch import nn

    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

Positives = Literal["document", "best"]


@dataclass
class QuerySideConfig(TrainConfig):
    """The query-side recipe. Defaults: the check that motivated it (issue 42: bs 32, 150 steps, lr 2e-5,
    temperature 0.02, merged 0.5), re-derived on the shipped KB on 5 document folds of the 213 training questions
    (docs/training.md, "Query-side tuning"): the best chunk as the positive won there (+0.027 MRR@10, passage hit@5
    +0.043 over every chunk of the document); temperature 0.05 and α 0.25 tied; α 0.75 and 1 lost."""

    cpu_bf16: ClassVar[bool] = True

    lr: float = field(default=2e-5, metadata={"help": "peak learning rate"})
    precision: Precision = field(
        default="auto",
        metadata={
            "help": "auto: bf16 on a GPU that has it (else fp16), on a CPU that multiplies bf16 natively (AVX-512-BF16 "
            "or AMX), else fp32 (bf16 kept the blind scores: docs/training.md)"
        },
    )
    fusion_scale_lr: float | None = field(
        default=1e-2,
        metadata={"help": "learning rate of the fusion scales s (--word-stream only: they start at 0)"},
    )
    max_steps: int | None = field(default=150, metadata={"help": "optimiser steps"})
    warmup_proportion: float = field(default=0.1, metadata={"help": "share of the steps the learning rate warms up"})
    max_length: int = field(default=64, metadata={"help": "tokens per question (prompt included)"})
    checkpoint_every: int = field(
        default=100,
        metadata={
            "help": "optimiser steps between checkpoints (100: one in tune's 150 steps, two thirds in; each writes "
            "the tower and Adam's state, about 1.4 s for the e5 base, and tune keeps every finished training anyway)"
        },
    )
    temperature: float = field(default=0.02, metadata={"help": "softmax temperature over the stored chunk vectors"})
    positives: Positives = field(
        default="best",
        metadata={"help": "best: the gold document's chunk the start model ranks first; document: every chunk of it"},
    )
    merge_alpha: float = field(
        default=0.5,
        metadata={"help": "weight of the trained query tower in the merge back toward the document tower (1: none)"},
    )
    word_stream: bool = field(
        default=False,
        metadata={"help": "train the query tower's word stream (a PolicyBERT start); off: it stays shut and skipped"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, ("temperature",))
        require_share(self, ("merge_alpha",), open_low=True)
        if self.positives not in Positives.__args__:
            raise InputError(f"--positives {self.positives!r}: expected one of {', '.join(Positives.__args__)}")


class QuerySideTask:
    """The :class:`training.loop.Task`: batches of questions, a softmax over every stored chunk vector."""

    def __init__(self, tokenizer: PolicyBertTokenizer, questions: StoredQuestions, cfg: QuerySideConfig, words: bool):
        import torch

        self.tokenizer, self.words, self.temperature = tokenizer, words, cfg.temperature
        self.texts = [tokenizer.query_prompt + text for text in questions.texts]
        self.encodings = tokenizer.encode(self.texts, max_length=cfg.max_length)
        self.positives = questions.positives
        self.weights = None if questions.weights is None else torch.tensor(questions.weights, dtype=torch.float32)
        self.vectors = torch.from_numpy(np.ascontiguousarray(questions.vectors, dtype=np.float32))

    def __len__(self) -> int:
        return len(self.texts)

    def batch(self, indices: list[int], key: str) -> dict[str, torch.Tensor]:
        import torch

        batch = dict(
            self.tokenizer.collate(
                [self.encodings[i] for i in indices], [self.texts[i] for i in indices], words=self.words
            )
        )
        mask = torch.zeros(len(indices), len(self.vectors), dtype=torch.bool)
        for row, i in enumerate(indices):
            mask[row, self.positives[i]] = True
        batch["positive_mask"] = mask
        if self.weights is not None:
            batch["weights"] = self.weights[indices]
        return batch

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        from chatchat_policybert.model.embeddings import sentence_vectors

        mask, weights = batch.pop("positive_mask"), batch.pop("weights", None)
        queries = sentence_vectors(model, batch, self.tokenizer.pooling)
        self.vectors = self.vectors.to(queries.device)
        logits = queries @ self.vectors.T / self.temperature
        positive = torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1)
        losses = torch.logsumexp(logits, dim=-1) - positive
        if weights is None:
            return losses.mean()
        weights = weights.to(losses.device)  # self-normalised in the batch: the scale of the loss stays that of 1s
        return (weights * losses).sum() / weights.sum()

    def evaluate(self, model: nn.Module) -> dict:
        """Nothing: questions held out of the training are scored by the caller (tune's folds), not per epoch."""
        return {}


def freeze_word_stream(model: nn.Module) -> None:
    """Shuts the word stream of a PolicyBERT start for training: its parameters get no gradient, so its fusion scales
    stay 0 and the forward pass skips it (:meth:`PolicyBertModel.word_stream_skipped`)."""
    for name, parameter in model.named_parameters():
        if name.startswith(("word_embeddings.", "word_encoder.", "fusions.", "fusion_scales")):
            parameter.requires_grad_(False)


def embed_questions(
    model: nn.Module, tokenizer: PolicyBertTokenizer, texts: Sequence[str], max_length: int, batch_size: int = 64
) -> np.ndarray:
    """Unit float32 vectors of ``texts`` with their query prompt, as the tower being trained computes them."""
    import torch

    from chatchat_policybert.model.embeddings import sentence_vectors

    words = not getattr(model, "word_stream_silent", lambda: True)()
    prompted = [tokenizer.query_prompt + text for text in texts]
    out = np.empty((len(prompted), model.config.hidden_size), dtype=np.float32)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(prompted), batch_size):
            part = prompted[start : start + batch_size]
            batch = tokenizer.collate(tokenizer.encode(part, max_length=max_length), part, words=words)
            batch = batch.to(next(model.parameters()).device)
            out[start : start + len(part)] = sentence_vectors(model, batch, tokenizer.pooling).cpu().numpy()
    model.train(was_training)
    return out


def best_positives(questions: StoredQuestions, start_vectors: np.ndarray) -> list[list[int]]:
    """Each question's gold chunk the start model ranks first (``--positives best``)."""
    return [
        [max(rows, key=lambda r: float(questions.vectors[r] @ q))]
        for rows, q in zip(questions.positives, start_vectors, strict=True)
    ]


def merge_back(model: nn.Module, reference: dict[str, torch.Tensor], alpha: float) -> None:
    """θ ← α·θ + (1 − α)·θ_reference for the trained parameters (``reference`` holds their starting values)."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in reference:
                parameter.mul_(alpha).add_(reference[name].to(parameter.device), alpha=1 - alpha)


def train_query_tower(
    start: Path, questions: StoredQuestions, cfg: QuerySideConfig
) -> tuple[nn.Module, PolicyBertTokenizer]:
    """The query tower trained from ``start``'s document tower on ``questions`` and merged back (module docstring);
    checkpoints and metrics in ``cfg.out`` (``--resume`` continues an interrupted run)."""
    from chatchat_policybert.model.loading import load_policybert
    from training.contrastive import freeze_piece_embeddings
    from training.loop import train

    model, tokenizer = load_policybert(start)
    if questions.vectors.shape[1] != model.config.hidden_size:
        raise InputError(
            f"the stored chunk vectors have {questions.vectors.shape[1]} dimensions, {start} embeds "
            f"{model.config.hidden_size}: the knowledge base was built with another model"
        )
    freeze_piece_embeddings(model)
    words = cfg.word_stream and bool(getattr(model.config, "word_vocab_size", 0))
    if cfg.word_stream and not words:
        raise InputError(f"--word-stream: {start} has no word stream (a PolicyBERT directory with a lexicon has one)")
    if not words:
        freeze_word_stream(model)
        cfg = dataclasses.replace(cfg, fusion_scale_lr=None)  # the scales stay 0: no group of their own to train
    if cfg.positives == "best":
        questions = dataclasses.replace(
            questions,
            positives=best_positives(questions, embed_questions(model, tokenizer, questions.texts, cfg.max_length)),
        )
    reference = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    train(model, QuerySideTask(tokenizer, questions, cfg, words), cfg)
    merge_back(model, reference, cfg.merge_alpha)
    return model.cpu().eval(), tokenizer


def two_tower_dir(start: Path, query_model: nn.Module, out: Path) -> Path:
    """``out``: ``start``'s directory (the document tower, its weights hard-linked where the file system allows,
    else copied) with ``query_model`` saved as its query tower; written whole or not at all."""
    from chatchat_policybert.files import atomic_path
    from chatchat_policybert.model.loading import WEIGHT_FILES, save_query_tower

    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        for item in sorted(Path(start).iterdir()):
            target = tmp / item.name
            if item.is_dir():
                shutil.copytree(item, target)
            elif item.name in WEIGHT_FILES:
                try:
                    os.link(item, target)  # the document tower is never rewritten: a link is the same bytes
                except OSError:
                    shutil.copy2(item, target)
            else:
                shutil.copy2(item, target)
        save_query_tower(tmp, query_model)
    return out


# ----------------------------------------------------------------------------- the command


@dataclass
class QuerySideInputs:
    """What a run reads: the start (the deployed model), the questions, and the KB whose stored vectors they rank."""

    model: Path = field(metadata={"help": "the model directory the knowledge base was embedded with"})
    questions: list[Path] = field(metadata={"help": "labelled questions (evaluation JSONL), one or more files"})
    chatchat_root: Path = field(metadata={"help": "the Chatchat root whose knowledge base holds the vectors"})
    kb: str = field(default="", metadata={"help": "knowledge base (default: the root's DEFAULT_KNOWLEDGE_BASE)"})
    corpus: Path | None = field(default=None, metadata={"help": "the policy CSV the questions' doc_title names"})


def run(cfg: QuerySideConfig, inputs: QuerySideInputs) -> Path:
    """Trains on every question of ``inputs`` and writes the two-tower directory ``OUT/final``."""
    from chatchat_policybert.deploy.crossfit import stored_questions

    bank, *_ = stored_questions(inputs.chatchat_root, inputs.kb, inputs.questions, inputs.corpus)
    model, _ = train_query_tower(inputs.model, bank, cfg)
    final = two_tower_dir(inputs.model, model, cfg.out / "final")
    print(f"query tower trained on {len(bank.texts)} questions: {final}")
    return final


def main(argv: list[str] | None = None) -> None:
    cfg, inputs = parse_flags(
        QuerySideConfig,
        argv,
        "python -m training.query_side",
        __doc__.split("\n\n")[0],
        extra=(QuerySideInputs,),
    )
    run(cfg, inputs)


if __name__ == "__main__":
    sys.exit(run_cli(main))

"""MLM with whole-word masking over lexicon words + NSP, resumable.

Masking picks 15 % of the real tokens of each pair in units: a lexicon word matched in the text is
one unit (all its characters are predicted, or none), every other character is a unit of its own.
Each predicted token is replaced by ``[MASK]`` (80 %), a random character (10 %) or kept (10 %).
Words that cover a predicted token are removed from the word stream, which would otherwise hand the
model the answer. NSP pairs are consecutive sentences of one document, half of them (exactly)
with the second sentence replaced by one from another document. Held-out documents, never
trained on, give MLM loss / accuracy / perplexity and NSP accuracy after every epoch
(``metrics.json``). Every ``--checkpoint-every`` optimiser steps the full training state is saved;
``--resume`` continues from it to exactly the state an uninterrupted run would have reached.
Runs on :mod:`training.loop`, alone or under ``torchrun``; ``--preset policysm2`` is the thesis's
PolicySM-2 pre-training (5 epochs).

    python -m training.pretrain --model runs/merged --corpus runs/corpus/corpus.jsonl --out runs/pretrain
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from chatchat_policybert.errors import InputError, run_cli
from training._common import Document, SentencePair, read_corpus
from training.config import TrainConfig, parse_flags, require_share

if TYPE_CHECKING:  # torch and the model load with a run, not with --help
    import torch
    from torch import nn
    from transformers import BertForPreTraining

    from chatchat_policybert.model.modeling_policybert import PolicyBertForPreTraining
    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

IS_NEXT, IS_RANDOM = 0, 1  # BERT's (and PolicyBertForPreTraining's) next_sentence_label convention
WordSpan = tuple[int, int, int]  # (word id, first token, one past the last token), as PolicyBertTokenizer returns them


# The thesis's PolicySM-2 pre-training ran 5 epochs; everything else as the defaults.
PRESETS = {"policysm2": {"epochs": 5}}


@dataclass
class PretrainInputs:
    """What the stage reads; kept out of :class:`PretrainConfig` so that moved inputs can still be resumed."""

    model: Path = field(
        metadata={
            "help": "model dir to start from: PolicyBERT (training.merge_bge) "
            "or plain BERT (bge, training.init_scratch)"
        }
    )
    corpus: Path = field(metadata={"help": "corpus.jsonl from training.corpus"})


@dataclass
class PretrainConfig(TrainConfig):
    """Thesis defaults (lr 3e-5, batch 32, 3 epochs, warm-up 0.9; ``--preset policysm2``: 5 epochs).

    ``seed`` drives the training randomness (order, masks, dropout); ``data_seed`` the held-out
    documents, the NSP pairs and the held-out masks, so that runs with different seeds are scored
    on the very same held-out set.
    """

    lr: float = field(default=3e-5, metadata={"help": "peak learning rate"})
    mlm_probability: float = field(default=0.15, metadata={"help": "share of tokens predicted"})
    eval_fraction: float = field(default=0.05, metadata={"help": "share of sentences held out (whole documents)"})
    shuffle_words: bool = field(
        default=True, metadata={"help": "shuffle the word stream (--no-shuffle-words: text order)"}
    )
    data_seed: int = field(default=42, metadata={"help": "held-out documents, NSP pairs and held-out masks"})

    def __post_init__(self) -> None:
        super().__post_init__()
        require_share(self, ("mlm_probability", "eval_fraction"), open_low=True, open_high=True)


def split_documents(docs: list[Document], eval_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """Holds out whole documents (at least two, for random NSP partners) with ≥ ``eval_fraction`` of the sentences."""
    usable = [doc for doc in docs if len(doc.sentences) >= 2]
    if len(usable) < 4:
        raise InputError(f"pre-training needs at least 4 documents with two sentences, the corpus has {len(usable)}")
    order = list(usable)
    random.Random(f"{seed}-heldout").shuffle(order)
    target = eval_fraction * sum(len(doc.sentences) for doc in usable)
    held, count = [], 0
    while len(held) < 2 or (count < target and len(order) - len(held) > 2):
        held.append(order[len(held)])
        count += len(held[-1].sentences)
    held_ids = {doc.doc_id for doc in held}
    return [doc for doc in usable if doc.doc_id not in held_ids], held


def nsp_examples(docs: list[Document], seed: int) -> list[SentencePair]:
    """Consecutive sentence pairs, exactly half with B swapped for a sentence of another document."""
    rng = random.Random(f"{seed}-nsp")
    slots = [(d, i) for d, doc in enumerate(docs) for i in range(len(doc.sentences) - 1)]
    labels = [IS_RANDOM] * (len(slots) // 2) + [IS_NEXT] * (len(slots) - len(slots) // 2)
    rng.shuffle(labels)
    everywhere = [(d, s) for d, doc in enumerate(docs) for s in doc.sentences]
    examples = []
    for (d, i), label in zip(slots, labels):
        b = docs[d].sentences[i + 1]
        if label == IS_RANDOM:
            other = d
            while other == d:
                other, b = rng.choice(everywhere)
        examples.append(SentencePair(docs[d].sentences[i], b, label))
    return examples


def whole_word_units(spans: list[WordSpan], candidates: list[int]) -> list[list[int]]:
    """Masking units: matched words (longest first, never overlapping) and the remaining single tokens."""
    allowed, covered, units = set(candidates), set(), []
    for _, first, last in sorted(spans, key=lambda s: (s[1] - s[2], s[1])):
        positions = range(first, last)
        if last - first > 1 and allowed.issuperset(positions) and covered.isdisjoint(positions):
            units.append(list(positions))
            covered.update(positions)
    units.extend([p] for p in candidates if p not in covered)
    return sorted(units)


def mask_units(
    input_ids: list[int],
    units: list[list[int]],
    rng: random.Random,
    probability: float,
    mask_id: int,
    replacements: list[int],
) -> tuple[list[int], list[int]]:
    """BERT's selection with whole units: up to ``probability`` of the tokens, no unit split; then 80/10/10."""
    budget = max(1, round(probability * sum(map(len, units))))
    order = list(units)
    rng.shuffle(order)
    chosen: list[int] = []
    for unit in order:
        if len(chosen) >= budget:
            break
        if len(chosen) + len(unit) <= budget:
            chosen.extend(unit)
    ids, labels = list(input_ids), [-100] * len(input_ids)
    for p in chosen:
        labels[p] = input_ids[p]
        draw = rng.random()
        if draw < 0.8:
            ids[p] = mask_id
        elif draw < 0.9:
            ids[p] = rng.choice(replacements)
    return ids, labels


def make_batch(
    tokenizer: PolicyBertTokenizer,
    examples: list[SentencePair],
    keys: list[str],
    seed: int,
    cfg: PretrainConfig,
    shuffle_words: bool,
) -> dict[str, torch.Tensor]:
    """Tokenises, masks each example with a generator seeded by (``seed``, its key) and hides words over masked tokens.

    Seeding per example, not per run, makes a batch independent of what came before it, which is
    what lets ``--resume`` reproduce an uninterrupted run.
    """
    import torch

    tok = tokenizer.tokenizer
    special = set(tok.all_special_ids)
    replacements = [i for i in range(len(tok)) if i not in special]
    word_seed = random.Random(f"{seed}-words-{keys[0]}").getrandbits(32)
    enc = tokenizer(
        [e.a for e in examples],
        [e.b for e in examples],
        max_length=cfg.max_length,
        shuffle_words=shuffle_words,
        seed=word_seed,
        return_word_spans=True,
    )
    spans = enc.pop("word_spans", None)
    input_ids, labels = [], []
    for i, key in enumerate(keys):
        ids = enc["input_ids"][i].tolist()
        mask = enc["attention_mask"][i].tolist()
        candidates = [p for p, (t, m) in enumerate(zip(ids, mask)) if m and t not in special]
        units = whole_word_units(spans[i] if spans else [], candidates)
        rng = random.Random(f"{seed}-mask-{key}")
        masked, target = mask_units(ids, units, rng, cfg.mlm_probability, tok.mask_token_id, replacements)
        input_ids.append(masked)
        labels.append(target)
    batch = dict(enc)
    batch["input_ids"] = torch.tensor(input_ids)
    batch["labels"] = torch.tensor(labels)
    batch["next_sentence_label"] = torch.tensor([e.label for e in examples])
    if "word_ids" in batch:
        predicted = (batch["labels"] != -100).float()
        leak = torch.einsum("btw,bt->bw", batch["word_matching_matrix"], predicted) > 0
        batch["word_ids"] = batch["word_ids"].masked_fill(leak, 0)
        batch["word_attention_mask"] = batch["word_attention_mask"].masked_fill(leak, 0)
        batch["word_matching_matrix"] = batch["word_matching_matrix"] * (~leak)[:, None, :]
    return batch


def evaluate(
    model: PolicyBertForPreTraining, tokenizer: PolicyBertTokenizer, examples: list[SentencePair], cfg: PretrainConfig
) -> dict[str, float]:
    """MLM loss, accuracy and perplexity over the masked tokens and NSP accuracy; masks are fixed by ``data_seed``.

    The caller puts the model in eval mode (and autocast): :func:`training.loop.evaluating`.
    """
    import torch

    device = next(model.parameters()).device
    loss_sum = correct = masked = nsp_correct = 0.0
    for start in tqdm(range(0, len(examples), cfg.eval_batch_size), desc="evaluating", unit="batch", leave=False):
        chunk = examples[start : start + cfg.eval_batch_size]
        keys = [f"eval-{start + i}" for i in range(len(chunk))]
        batch = make_batch(tokenizer, chunk, keys, cfg.data_seed, cfg, shuffle_words=False)
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        nsp_labels = batch.pop("next_sentence_label")
        out = model(**batch)
        logits = out.prediction_logits.float()
        where = labels != -100
        loss_sum += torch.nn.functional.cross_entropy(logits[where], labels[where], reduction="sum").item()
        correct += (logits[where].argmax(-1) == labels[where]).sum().item()
        masked += where.sum().item()
        nsp_correct += (out.seq_relationship_logits.argmax(-1) == nsp_labels).sum().item()
    mlm_loss = loss_sum / max(masked, 1)
    return {
        "mlm_loss": round(mlm_loss, 4),
        "mlm_accuracy": round(correct / max(masked, 1), 4),
        "perplexity": round(math.exp(min(mlm_loss, 50.0)), 2),
        "nsp_accuracy": round(nsp_correct / len(examples), 4),
        "examples": len(examples),
        "masked_tokens": int(masked),
    }


class PretrainTask:
    """The :class:`training.loop.Task` of this stage: NSP pairs of the training documents, masked on the fly."""

    def __init__(self, tokenizer: PolicyBertTokenizer, docs: list[Document], cfg: PretrainConfig) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.train_docs, self.eval_docs = split_documents(docs, cfg.eval_fraction, cfg.data_seed)
        self.train = nsp_examples(self.train_docs, cfg.data_seed)
        self.held_out = nsp_examples(self.eval_docs, cfg.data_seed + 1)

    def __len__(self) -> int:
        return len(self.train)

    def batch(self, indices: list[int], key: str) -> dict[str, torch.Tensor]:
        keys = [f"{key}-{i}" for i in indices]
        return make_batch(
            self.tokenizer, [self.train[i] for i in indices], keys, self.cfg.seed, self.cfg, self.cfg.shuffle_words
        )

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    def evaluate(self, model: nn.Module) -> dict:
        return evaluate(model, self.tokenizer, self.held_out, self.cfg)


def pretrain(
    model: PolicyBertForPreTraining,
    tokenizer: PolicyBertTokenizer,
    docs: list[Document],
    cfg: PretrainConfig,
    inputs: PretrainInputs | None = None,
) -> tuple[list[dict], bool]:
    """Trains in place; returns the per-epoch metrics (also in ``cfg.out/metrics.json``) and whether all steps ran.

    ``inputs``, the command line's, only goes into ``run.json`` (see :func:`training.loop.train`).
    """
    from training.loop import is_main_process, train

    task = PretrainTask(tokenizer, docs, cfg)
    if is_main_process():
        print(
            f"pre-training: {len(task.train)} NSP pairs from {len(task.train_docs)} documents, "
            f"{len(task.held_out)} held-out pairs from {len(task.eval_docs)} documents"
        )
    return train(model, task, cfg, inputs)


def load_start_model(model_dir: Path) -> tuple[PolicyBertForPreTraining | BertForPreTraining, PolicyBertTokenizer]:
    """The model this stage trains, from its ``--model``; ``training.export`` rebuilds a checkpoint into the same model.

    A plain BERT directory (bge, or ``training.init_scratch``'s) trains as ``BertForPreTraining``:
    it has no lexicon, so its masking is per character, and its ``final/`` is again a plain BERT
    directory that ``training.merge_bge --bge`` and ``training.contrastive`` take.
    """
    from transformers import BertForPreTraining

    from chatchat_policybert.model.loading import load_model_dir, read_config, resolve_model_dir
    from chatchat_policybert.model.modeling_policybert import PolicyBertForPreTraining

    model_class = (
        BertForPreTraining
        if read_config(resolve_model_dir(model_dir))["model_type"] == "bert"
        else PolicyBertForPreTraining
    )
    return load_model_dir(model_dir, model_class, allow_missing=("cls.", "pooler."))


def run(cfg: PretrainConfig, inputs: PretrainInputs) -> tuple[list[dict], bool]:
    """The stage: pre-trains ``inputs.model`` on ``inputs.corpus``; a finished run's main process saves ``OUT/final``.

    Returns :func:`pretrain`'s per-epoch metrics and whether all steps ran.
    """
    import torch

    from chatchat_policybert.model.loading import save_model_dir
    from training.loop import is_main_process

    docs = read_corpus(inputs.corpus)
    # The MLM/NSP heads (and a pooler a merged dir may lack) are what this stage creates: seeded, they start
    # from the same draw in every run and every process, so a resumed or multi-process run matches.
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_start_model(inputs.model)
    history, finished = pretrain(model, tokenizer, docs, cfg, inputs)
    if finished and is_main_process():
        save_model_dir(model, tokenizer, cfg.out / "final")
        print(f"model → {cfg.out / 'final'}")
    return history, finished


def main(argv: list[str] | None = None) -> None:
    cfg, inputs = parse_flags(
        PretrainConfig,
        argv,
        "python -m training.pretrain",
        __doc__.split("\n\n")[0],
        extra=(PretrainInputs,),
        presets=PRESETS,
    )
    run(cfg, inputs)


if __name__ == "__main__":
    sys.exit(run_cli(main))

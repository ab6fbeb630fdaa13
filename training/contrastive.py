"""Contrastive training of the embedding model (InfoNCE, bge's fine-tuning recipe).

Each training example is a query with one positive passage and ``--train-group-size - 1`` hard
negatives drawn from its FlagEmbedding-format line (``{"query": str, "pos": [str], "neg": [str]}``,
as ``training.pairs`` writes them, or your own). Every query is scored against every passage of
the micro-batch — its positive, its own hard negatives and all other queries' passages (in-batch
negatives) — and, across processes, against every other process's passages too (FlagEmbedding's
``negatives_cross_device``); the loss is the cross-entropy of the positive at temperature
``--temperature`` (0.02, bge's). Queries carry the model directory's query prompt (bge's retrieval
instruction, e5's ``query: ``; ``--query-instruction`` replaces it), documents its document prompt where it
has one (e5's ``passage: ``), and vectors are the directory's pooling (bge's [CLS] state, e5's mean),
L2-normalised, computed by :func:`chatchat_policybert.model.embeddings.sentence_vectors` on the tokenizer's
own batches: the model is trained on exactly the vectors it will serve.

The character encoder, the word stream, the fusions and the fusion scales ``s`` all train;
``--freeze-chars`` trains only the word side (word embeddings and encoder, fusions, ``s``).
After every epoch the dev file (held-out documents) is ranked: MRR@10 and Recall@1/5/10 of the
query's positives among all dev passages, and the dev loss, go to ``OUT/metrics.json``. The model
goes to ``OUT/final``, a directory that ``PolicyBertEmbeddings`` and ``chatchat-policybert setup
--model`` load.

    python -m training.contrastive --model runs/pretrain/final --train runs/pairs/train.jsonl \\
        --dev runs/pairs/dev.jsonl --out runs/contrastive
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from chatchat_policybert.errors import InputError, run_cli
from chatchat_policybert.evaluation.metrics import mrr_at_k, rank_by_score, recall_at_k
from training._common import jsonl_lines
from training.config import TrainConfig, parse_flags, require_positive

if TYPE_CHECKING:  # torch and the model load with a run, not with --help
    import torch
    from torch import nn
    from transformers import PreTrainedModel

    from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer

RECALL_KS = (1, 5, 10)
MRR_K = 10


@dataclass
class ContrastiveConfig(TrainConfig):
    """bge's fine-tuning defaults (lr 1e-5, warm-up 0.1, temperature 0.02, 1 positive + 7 hard negatives per query).

    ``batch_size`` counts queries per optimiser step; each brings ``train_group_size`` passages.
    A query's negatives are the passages of its micro-batch on every process:
    ``batch_size / grad_accum × train_group_size`` in all, less its positive.
    """

    lr: float = field(default=1e-5, metadata={"help": "peak learning rate"})
    warmup_proportion: float = field(
        default=0.1, metadata={"help": "share of the steps the learning rate warms up over"}
    )
    epochs: int = field(default=1, metadata={"help": "passes over the training queries"})
    max_length: int = field(
        default=512, metadata={"help": "tokens per query or passage (capped by the model's positions)"}
    )
    temperature: float = field(default=0.02, metadata={"help": "InfoNCE temperature (bge: 0.02)"})
    train_group_size: int = field(
        default=8, metadata={"help": "passages per query: 1 positive + N-1 hard negatives (1: in-batch negatives only)"}
    )
    freeze_chars: bool = field(
        default=False, metadata={"help": "train only the word side (word embeddings/encoder, fusions, s)"}
    )
    freeze_piece_embeddings: bool = field(
        default=False,
        metadata={
            "help": "keep the token-piece embedding matrix (vocabulary x hidden: 96 M parameters in e5-small) as the "
            "start has it: no gradient, no AdamW state for it (~770 MB less), the pretrained rows protected"
        },
    )
    query_instruction: str | None = field(
        default=None,
        metadata={
            "help": "prefix of every query (default: the --model directory's query prompt, else bge's instruction); "
            "saved with the model, whose queries are served with it"
        },
    )

    embed_chunk: int | None = field(
        default=None,
        metadata={
            "help": "texts per forward pass within a step (one process only): each chunk's activations are "
            "recomputed in the backward pass, so memory holds one chunk's, not the whole batch's "
            "(queries + queries x train_group_size texts); the loss and gradient are the whole batch's"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, ("temperature", "train_group_size", "embed_chunk"))


@dataclass
class ContrastiveInputs:
    """The stage's inputs, kept out of the settings a resumed run compares."""

    model: Path = field(metadata={"help": "model directory to start from (PolicyBERT, or plain BERT/bge)"})
    train: Path = field(metadata={"help": "training pairs, FlagEmbedding jsonl (training.pairs' train.jsonl)"})
    dev: Path = field(metadata={"help": "held-out pairs for MRR/Recall after every epoch (training.pairs' dev.jsonl)"})


@dataclass(frozen=True)
class Example:
    """One FlagEmbedding-format line: a query, its positive passages and its hard negatives."""

    query: str
    pos: tuple[str, ...]
    neg: tuple[str, ...]


def read_examples(path: Path, negatives_needed: int) -> list[Example]:
    """Reads a FlagEmbedding-format jsonl file; a line that does not fit is an ``InputError`` naming it.

    ``negatives_needed`` (``train_group_size - 1``) > 0 requires at least one negative per line:
    fewer than needed are drawn with repetition, as FlagEmbedding does, but none cannot be.
    """
    path = Path(path)
    examples = []
    for lineno, line in jsonl_lines(path, "pairs file not found (write one with `python -m training.pairs`)"):
        try:
            obj = json.loads(line)
            query, pos, neg = obj["query"], obj["pos"], obj.get("neg", [])
            if not isinstance(query, str) or not query or not isinstance(pos, list) or not isinstance(neg, list):
                raise TypeError
            if not pos or not all(isinstance(t, str) and t for t in pos + neg):
                raise ValueError
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{path}:{lineno}: not a pairs line ({exc.__class__.__name__}); expected "
                '{"query": "…", "pos": ["…", …], "neg": ["…", …]} with non-empty strings and at least one pos'
            ) from None
        if negatives_needed and not neg:
            raise InputError(
                f"{path}:{lineno}: no negatives, but --train-group-size asks for {negatives_needed} per query; "
                "add negatives or pass --train-group-size 1 (in-batch negatives only)"
            )
        examples.append(Example(query, tuple(pos), tuple(neg)))
    if not examples:
        raise InputError(f"{path}: no pairs in the file")
    suspect = [i for i, e in enumerate(examples, 1) if any(e.query in n or n in e.pos for n in e.neg)]
    if suspect:
        # A user's own FlagEmbedding file can carry false negatives; they would be trained away from the query.
        print(
            f"warning: {path}: {len(suspect)} of {len(examples)} pairs have a negative that contains the query or "
            f"equals a positive (first: pair {suspect[0]}); they are trained as negatives",
            file=sys.stderr,
        )
    return examples


def gather_passages(passages: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every process's passage vectors (gradients flow back to each process's own) and where this one's start.

    ``torch.distributed.nn.functional.all_gather`` sums the gradients of all processes' losses
    into each process's passages, so the averaged gradient is that of the global loss. Processes
    may hold different counts (a short last batch): each pads to the largest, and the padding is cut.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return passages, 0
    count = torch.tensor([len(passages)], device=passages.device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    padded = F.pad(passages, (0, 0, 0, max(sizes) - len(passages)))
    parts = torch.distributed.nn.functional.all_gather(padded)
    gathered = torch.cat([part[:size] for part, size in zip(parts, sizes)])
    return gathered, sum(sizes[: dist.get_rank()])


def info_nce(queries: torch.Tensor, passages: torch.Tensor, group_size: int, temperature: float) -> torch.Tensor:
    """Mean InfoNCE of unit ``queries`` (n) over unit ``passages`` (n × group_size, query i's positive at i ×
    group_size).

    Each query is scored against all passages of all processes (:func:`gather_passages`).
    """
    import torch
    import torch.nn.functional as F

    candidates, offset = gather_passages(passages)
    scores = queries @ candidates.T / temperature
    targets = offset + torch.arange(len(queries), device=queries.device) * group_size
    return F.cross_entropy(scores, targets)


def freeze_piece_embeddings(model: nn.Module) -> None:
    """Stops gradients to the token-piece embedding matrix (the character stream's, not the word stream's).

    A few thousand of a multilingual vocabulary's 250 k rows occur in one knowledge base's pairs; the
    rest would only be moved by weight decay, and AdamW keeps two float32 copies of the whole matrix.
    """
    model.get_input_embeddings().weight.requires_grad_(False)


def freeze_character_encoder(model: nn.Module) -> None:
    """Stops gradients to the character embeddings and layers; the word side, fusions and ``s`` still train."""
    if not getattr(model.config, "word_vocab_size", 0):
        raise InputError("--freeze-chars needs a PolicyBERT model with a word stream; this model has none")
    for parameter in [*model.embeddings.parameters(), *model.encoder.parameters()]:
        parameter.requires_grad_(False)


class ContrastiveTask:
    """The :class:`training.loop.Task` of this stage: batches of (query, passages) groups and InfoNCE."""

    def __init__(
        self,
        tokenizer: PolicyBertTokenizer,
        train: list[Example],
        dev: list[Example],
        cfg: ContrastiveConfig,
        max_length: int,
    ):
        self.tokenizer = tokenizer
        self.train = train
        self.dev = dev
        self.cfg = cfg
        self.max_length = max_length
        # The dev ranking's fixed inputs: every distinct pos and neg of the dev file, and the queries with the
        # instruction.
        self.dev_pool = list(dict.fromkeys(text for e in dev for text in (*e.pos, *e.neg)))
        self.dev_position = {text: i for i, text in enumerate(self.dev_pool)}
        self.dev_queries = [tokenizer.query_prompt + e.query for e in dev]

    def __len__(self) -> int:
        return len(self.train)

    def group(self, example: Example, rng: random.Random) -> list[str]:
        """One positive and ``train_group_size - 1`` negatives, drawn as FlagEmbedding draws them."""
        wanted = self.cfg.train_group_size - 1
        negatives = list(example.neg)
        if len(negatives) < wanted:
            negatives = negatives * math.ceil(wanted / len(negatives))
        return [rng.choice(example.pos), *rng.sample(negatives, wanted)]

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The serving tokenisation (:meth:`PolicyBertTokenizer.__call__`: encode, then collate with the k_w cut)."""
        return dict(self.tokenizer(texts, max_length=self.max_length))

    def batch(self, indices: list[int], key: str) -> dict[str, torch.Tensor]:
        """Queries (with the instruction) then their groups, in one padded batch; draws seeded by ``key``."""
        rng = random.Random(f"{self.cfg.seed}-{key}")
        examples = [self.train[i] for i in indices]
        passages = [self.tokenizer.document_prompt + text for example in examples for text in self.group(example, rng)]
        return self.tokenize([self.tokenizer.query_prompt + e.query for e in examples] + passages)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """InfoNCE over one forward pass of queries and passages together (one forward per step suits DDP).

        The batch holds n queries then their n × ``train_group_size`` passages (:meth:`batch`), so n
        follows from its row count, with no tensor to read back from the device.
        """
        num_queries = len(batch["input_ids"]) // (1 + self.cfg.train_group_size)
        vectors = self.vectors(model, batch)
        return info_nce(vectors[:num_queries], vectors[num_queries:], self.cfg.train_group_size, self.cfg.temperature)

    def vectors(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """:func:`sentence_vectors` of the batch (the tokenizer's pooling); with ``embed_chunk``, ``embed_chunk`` rows
        at a time under activation checkpointing.

        Why: the attention of one padded batch of ``batch_size × (1 + train_group_size)`` texts of
        512 tokens holds gigabytes for the backward pass (eager attention keeps every head's
        512 × 512 scores, probabilities and dropout mask per text), whatever the model's width.
        Checkpointed chunks keep only their inputs and the vectors; the backward pass recomputes
        one chunk at a time (same random state, same autocast), so the loss and the gradient stay
        the whole batch's — InfoNCE still scores every query against every passage of the batch.
        """
        import torch
        import torch.distributed as dist
        from torch.utils.checkpoint import checkpoint

        from chatchat_policybert.model.embeddings import sentence_vectors

        pooling = self.tokenizer.pooling
        rows, chunk = len(batch["input_ids"]), self.cfg.embed_chunk
        if chunk is None or rows <= chunk or not torch.is_grad_enabled():
            return sentence_vectors(model, batch, pooling)
        if dist.is_available() and dist.is_initialized():
            raise InputError("--embed-chunk runs in one process (DistributedDataParallel expects one forward a step)")
        parts = [
            checkpoint(
                sentence_vectors,
                model,
                {k: v[start : start + chunk] for k, v in batch.items()},
                pooling,
                use_reentrant=False,
            )
            for start in range(0, rows, chunk)
        ]
        return torch.cat(parts)

    def embed(self, model: nn.Module, texts: list[str]) -> torch.Tensor:
        """Unit vectors of ``texts`` in batches of ``eval_batch_size`` (longest first, as serving sorts)."""
        import torch

        from chatchat_policybert.model.embeddings import sentence_vectors

        device = next(model.parameters()).device
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        pooling = self.tokenizer.pooling
        vectors = torch.empty(len(texts), model.config.hidden_size)
        for start in tqdm(range(0, len(order), self.cfg.eval_batch_size), desc="dev", unit="batch", leave=False):
            index = order[start : start + self.cfg.eval_batch_size]
            batch = self.tokenize([texts[i] for i in index])
            vectors[index] = sentence_vectors(model, {k: v.to(device) for k, v in batch.items()}, pooling).cpu()
        return vectors

    def evaluate(self, model: nn.Module) -> dict:
        """Ranks all dev passages (every pos and neg of the dev file) for each dev query.

        ``dev_loss`` is ``-log`` of the softmax mass (at the training temperature) on the query's
        positives among all dev passages, a loss that falls as ranking improves. Without dev pairs (a caller
        that scores the model its own way, as ``training.ablate --task retrieval``) there is nothing to rank.
        """
        if not self.dev:
            return {}
        per_query = self.rank_dev(model)
        return {
            "dev_loss": round(float(np.mean(per_query["loss"])), 4),
            f"mrr@{MRR_K}": round(float(np.mean(per_query[f"mrr@{MRR_K}"])), 4),
            **{f"recall@{k}": round(float(np.mean(per_query[f"recall@{k}"])), 4) for k in RECALL_KS},
            "dev_queries": len(self.dev),
            "dev_passages": len(self.dev_pool),
        }

    def rank_dev(self, model: nn.Module) -> dict[str, list[float]]:
        """Per dev query, in the dev file's order: MRR@10, Recall@1/5/10 and the loss of :meth:`evaluate`.

        Kept per query so that two models can be compared query by query (a paired bootstrap,
        as ``training.ablate --task retrieval`` does).
        """
        import torch

        position = self.dev_position
        queries = self.embed(model, self.dev_queries)
        scores = (queries @ self.embed(model, [self.tokenizer.document_prompt + t for t in self.dev_pool]).T).numpy()
        per_query: dict[str, list[float]] = {f"mrr@{MRR_K}": [], **{f"recall@{k}": [] for k in RECALL_KS}, "loss": []}
        for example, row in zip(self.dev, scores):
            ranked = rank_by_score(row, depth=max(MRR_K, *RECALL_KS))
            relevant = {position[text] for text in example.pos}
            per_query[f"mrr@{MRR_K}"].append(mrr_at_k(ranked, relevant, MRR_K))
            for k in RECALL_KS:
                per_query[f"recall@{k}"].append(recall_at_k(ranked, relevant, k))
            logits = torch.from_numpy(row).double() / self.cfg.temperature
            per_query["loss"].append(float(logits.logsumexp(0) - logits[sorted(relevant)].logsumexp(0)))
        return per_query


def contrastive(
    model: nn.Module,
    tokenizer: PolicyBertTokenizer,
    train_examples: list[Example],
    dev_examples: list[Example],
    cfg: ContrastiveConfig,
    inputs: ContrastiveInputs | None = None,
) -> tuple[list[dict], bool]:
    """Trains ``model`` in place on the pairs; returns the per-epoch metrics and whether all steps ran.

    ``tokenizer`` takes ``cfg.query_instruction`` where it is given, so that every directory saved from it
    (``final/`` here and in ``training.tune``) serves queries with the instruction the model was trained with;
    its document prompt and pooling are the start directory's, kept the same way.
    ``inputs``, the command line's, only goes into ``run.json`` (see :func:`training.loop.train`).
    """
    from chatchat_policybert.model.embeddings import token_limit
    from training.loop import is_main_process, train

    if cfg.query_instruction is not None:
        tokenizer.query_instruction = cfg.query_instruction
    if cfg.freeze_chars:
        freeze_character_encoder(model)
    if cfg.freeze_piece_embeddings:
        freeze_piece_embeddings(model)
    task = ContrastiveTask(tokenizer, train_examples, dev_examples, cfg, token_limit(model, cfg.max_length))
    if is_main_process():
        print(
            f"contrastive: {len(train_examples)} training queries, {len(dev_examples)} dev queries; "
            f"{cfg.train_group_size} passages per query, temperature {cfg.temperature}"
            + (", character encoder frozen" if cfg.freeze_chars else "")
            + (", piece embeddings frozen" if cfg.freeze_piece_embeddings else "")
        )
    return train(model, task, cfg, inputs)


def load_start_model(model_dir: Path) -> tuple[PreTrainedModel, PolicyBertTokenizer]:
    """The model this stage trains, from its ``--model``; ``training.export`` rebuilds a checkpoint into the same model.

    A merged or pre-trained directory may lack the pooler; neither [CLS] nor mean pooling uses it.
    """
    from chatchat_policybert.model.loading import load_policybert

    return load_policybert(model_dir)


def run(cfg: ContrastiveConfig, inputs: ContrastiveInputs) -> tuple[list[dict], bool]:
    """The stage: trains ``inputs.model`` on the pairs; a finished run's main process saves ``OUT/final``.

    Returns :func:`contrastive`'s per-epoch metrics and whether all steps ran.
    """
    from chatchat_policybert.model.loading import save_model_dir
    from training.loop import is_main_process

    # The pairs are read first: a bad line is reported before minutes go into loading a model.
    train_examples = read_examples(inputs.train, cfg.train_group_size - 1)
    dev_examples = read_examples(inputs.dev, 0)
    model, tokenizer = load_start_model(inputs.model)
    history, finished = contrastive(model, tokenizer, train_examples, dev_examples, cfg, inputs)
    if finished and is_main_process():
        save_model_dir(model, tokenizer, cfg.out / "final")
        print(f"model → {cfg.out / 'final'}")
    return history, finished


def main(argv: list[str] | None = None) -> None:
    cfg, inputs = parse_flags(
        ContrastiveConfig, argv, "python -m training.contrastive", __doc__.split("\n\n")[0], extra=(ContrastiveInputs,)
    )
    run(cfg, inputs)


if __name__ == "__main__":
    sys.exit(run_cli(main))

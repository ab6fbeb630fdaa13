"""Does the word stream earn its place? The retrieval ablation against plain fine-tuning of the same start.

From one pre-trained character-only start (``training.init_scratch`` + ``training.pretrain``,
built once in ``OUT/start`` and cached; ``--start DIR`` for one of your own, e.g. bge), every arm
gets the same pairs (``training.pairs`` on ``--corpus``, cached in ``OUT/pairs``), steps, batch,
learning rate, temperature and seeds:

- ``base``: the start, untrained for retrieval (stock bge's place); scored once, it has no seed;
- ``base+ft``: the start trained contrastively, no word stream: the competitor every user has;
- ``none``, ``gate``, ``attn``: ``merge_bge --init bge`` from the start (it embeds exactly as the
  start until ``s`` moves), then the same contrastive training with ``--fusion-scale-lr``;
- ``attn-freeze``: as ``attn``, but only the word side trains (``--freeze-chars``);
- levers, one change each from ``attn``: ``attn-slr-low`` / ``attn-slr-high`` (the scales' rate
  ÷10 / ×10), ``attn-warm`` (the first 30 % of the steps with frozen characters, then joint),
  ``attn-2wl`` (two word layers), ``attn-early`` (no fusion past the word layers), ``attn-kblex``
  (a lexicon built from the corpus itself by ``training.build_lexicon`` instead of ``--lexicon``),
  ``attn-open`` (``merge_bge --init thesis``: the word stream fully open from the first step).

Each arm is scored on the dev split of held-out documents (``training.contrastive``'s own ranking
of the dev pool, and BM25 on that pool; ``--dev-pool false`` skips it), on the dev pairs as questions
over the corpus's Chatchat chunks (what ``tune``'s gate judges on, with what the gate would decide for
each trained run against ``base``), and on every ``--questions`` file over those chunks (a table each),
dense and through Chatchat's own ``search_docs`` (the ensemble the RAG tab uses; a temporary root
and ``kb -r`` per model), with BM25 alone as a row. Beside each arm: its fusion scales after
training, how far the word stream moves the character states (per layer, ‖H − H_chars‖ / ‖H_chars‖
with and without the words), and its embedding speed against the start (same run, same texts);
under the table, how often questions and chunks match lexicon words at all, for both lexicons. ``OUT/results.md``
holds the tables (mean ± sd over seeds; the paired-bootstrap delta of each arm vs ``base`` and vs ``base+ft`` over
questions, with each question's score averaged over seeds) and ``OUT/results.png`` the chart.
An arm that finished (``OUT/runs/ARM-seedN/result.json``) is not run again.

    python -m training.ablate --task retrieval --out runs/ablate-retrieval
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from chatchat_policybert.data import CORPUS_CSV, LEXICON, QUESTIONS, STOPWORDS
from chatchat_policybert.deploy.questions import pair_queries
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation import evaluate, scoring
from chatchat_policybert.evaluation.dataset import load_corpus, load_questions
from chatchat_policybert.evaluation.gate_rule import DEV_PAIRS, gate_failure
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks, prepare_root
from chatchat_policybert.evaluation.metrics import mrr_at_k, paired_bootstrap_interval, rank_by_score
from chatchat_policybert.evaluation.retrievers import Bm25, Dense
from chatchat_policybert.evaluation.scoring import RunResult, compare_runs
from chatchat_policybert.files import write_json
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.retrieval.analyzer import NEW_DEPLOYMENT, get_analyzer
from training import build_lexicon, contrastive, init_scratch, merge_bge, pairs, pretrain
from training import corpus as corpus_stage
from training.config import parse_flags, require_positive
from training.pairs.config import PairsConfig

MRR = "MRR@10"
DEPTH = 100  # chunks each dense ranking keeps, as ``chatchat-policybert eval --depth``
# Chatchat chunk texts for the speed column: the same texts for every model, so ratios compare models alone.
SPEED_TEXTS = 128


@dataclass(frozen=True)
class Arm:
    """One row of the ablation: which model it trains and how it differs from ``attn``'s settings."""

    fusion: str | None
    """None: no word stream (the start as it is); else the ``merge_bge --fusion``."""
    trains: bool = True
    freeze_chars: bool = False
    scale_lr_factor: float = 1.0
    """Multiplies ``--fusion-scale-lr``."""
    word_warmup: float = 0.0
    """Share of the steps trained with frozen characters before joint training (same total steps)."""
    num_word_layers: int | None = None
    """None: ``--num-word-layers``."""
    late_fusion: str = "add"
    """``merge_bge --late-fusion``: add the last word state to every layer past the word stream (ZEN), or none."""
    init: str = "bge"
    """``merge_bge --init``: bge (s = 0, the start's vectors exactly) or thesis (s = 1: the word stream open from step
    0)."""
    kb_lexicon: bool = False
    """The word stream over a lexicon built from the knowledge base itself (``training.build_lexicon``, jieba)."""


ARMS = {
    "base": Arm(None, trains=False),
    "base+ft": Arm(None),
    "none": Arm("none"),
    "gate": Arm("gate"),
    "attn": Arm("attn"),
    "attn-freeze": Arm("attn", freeze_chars=True),
    "attn-slr-low": Arm("attn", scale_lr_factor=0.1),
    "attn-slr-high": Arm("attn", scale_lr_factor=10.0),
    "attn-warm": Arm("attn", word_warmup=0.3),
    "attn-2wl": Arm("attn", num_word_layers=2),
    "attn-early": Arm("attn", late_fusion="none"),
    "attn-kblex": Arm("attn", kb_lexicon=True),
    "attn-open": Arm("attn", init="thesis"),
}
DEFAULT_ARMS = ["base", "base+ft", "none", "gate", "attn", "attn-freeze"]
COMPETITOR = "base+ft"


@dataclass
class RetrievalAblationConfig:
    """The ablation's settings: one budget for every arm (about one pass over the pairs; times in docs/training.md)."""

    out: Path = field(
        default=Path("runs/ablate-retrieval"), metadata={"help": "folder of everything the ablation writes"}
    )
    corpus: Path = field(
        default=CORPUS_CSV,
        metadata={"help": "policy CSV or folder: the start's vocabulary, its pre-training text, the pairs and the KB"},
    )
    lexicon: Path = field(default=LEXICON, metadata={"help": "word,count lexicon of the word stream"})
    questions: list[Path] | None = field(
        default=None,
        metadata={
            "help": "JSONL question files over --corpus (the evaluation's format), each scored and tabled on its own; "
            "the first plays the user's --questions in the gate decisions. None: the shipped ones"
        },
    )
    start: Path | None = field(
        default=None, metadata={"help": "a pre-trained plain BERT to start from (e.g. bge); None: build OUT/start"}
    )
    arms: list[str] = field(
        default_factory=lambda: list(DEFAULT_ARMS), metadata={"help": f"arms to run, of {', '.join(ARMS)}"}
    )
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "one run per trained arm and seed"})
    # The start (used only when --start is not given): its shape is init_scratch's flags (ScratchShape).
    start_steps: int = field(default=1500, metadata={"help": "start: MLM+NSP pre-training steps"})
    start_lr: float = field(default=1e-3, metadata={"help": "start: pre-training learning rate (from scratch)"})
    start_batch_size: int = field(default=32, metadata={"help": "start: sentence pairs per pre-training step"})
    # What every arm shares.
    num_word_layers: int = field(
        default=1, metadata={"help": "word layers of the fused arms (copies of the start's first layers)"}
    )
    steps: int = field(default=60, metadata={"help": "contrastive steps of every trained arm"})
    batch_size: int = field(default=32, metadata={"help": "queries per contrastive step"})
    train_group_size: int = field(default=4, metadata={"help": "passages per query: 1 positive + hard negatives"})
    lr: float = field(default=2e-4, metadata={"help": "contrastive learning rate"})
    fusion_scale_lr: float = field(default=1e-2, metadata={"help": "learning rate of the fusion scales s (fused arms)"})
    temperature: float = field(default=0.05, metadata={"help": "InfoNCE temperature"})
    max_length: int = field(default=256, metadata={"help": "tokens per training query or passage"})
    freeze_piece_embeddings: bool = field(
        default=False,
        metadata={"help": "every trained arm keeps the start's token-piece embedding matrix (contrastive's flag)"},
    )
    precision: str = field(
        default="fp32",
        metadata={
            "help": "fp32, or bf16: autocast in training and in every encoding (dense scoring, dev), checked against "
            "fp32 vectors of the start (OUT/bf16_check.json)"
        },
    )
    dev_pool: bool = field(
        default=True,
        metadata={
            "help": "also rank contrastive's dev pool (every dev pos and neg: one more encoding per model); the dev "
            "pairs are always scored as questions over the chunks, as tune's gate scores them"
        },
    )
    speed_texts: int = field(
        default=SPEED_TEXTS,
        metadata={"help": "Chatchat chunks of the speed column (each model embeds them 3 times); 0: no speed column"},
    )
    retrievers: str = field(
        default="dense,chatchat", metadata={"help": "question scoring: dense, and chatchat (a kb -r per model)"}
    )
    device: str = field(default="cpu", metadata={"help": "torch device of every stage"})
    table_only: bool = field(
        default=False,
        metadata={"help": "table the finished runs of --arms and --seeds only, start none (e.g. while others run)"},
    )
    threads: int = field(
        default=1,
        metadata={
            "help": "torch threads on CPU (1: two OpenMP threads on a shared 2-core machine spin-wait and run slower)"
        },
    )

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        unknown = sorted(set(self.arms) - set(ARMS))
        if unknown:
            raise InputError(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
        kinds = {k.strip() for k in self.retrievers.split(",") if k.strip()}
        if not kinds or kinds - {"dense", "chatchat"}:
            raise InputError(f"--retrievers {self.retrievers!r}: expected a comma list of dense, chatchat")
        if not self.seeds:
            raise InputError("--seeds: expected at least one seed")
        if self.precision not in ("fp32", "bf16"):
            raise InputError(f"--precision {self.precision!r}: expected fp32 or bf16")
        if self.speed_texts < 0:
            raise InputError(f"--speed-texts {self.speed_texts}: expected 0 or more")
        if self.questions is not None:
            self.questions = [Path(q) for q in self.questions]
            names = [question_set_name(q) for q in self.questions]
            twice = sorted({n for n in names if names.count(n) > 1} | ({DEV_PAIRS} & set(names)))
            if twice:
                raise InputError(
                    f"--questions: {', '.join(twice)} names two question sets (a set is named by its file's stem, "
                    f"and {DEV_PAIRS!r} is the dev pairs'): rename a file"
                )
        require_positive(
            self,
            (
                "start_steps",
                "start_lr",
                "start_batch_size",
                "num_word_layers",
                "steps",
                "batch_size",
                "train_group_size",
                "lr",
                "fusion_scale_lr",
                "temperature",
                "max_length",
                "threads",
            ),
        )


def corpus_file(cfg: RetrievalAblationConfig) -> Path:
    """``training.corpus`` of ``--corpus`` (cleaned sentences), once: the start's pre-training text and the KB
    lexicon's."""
    out = cfg.out / "start" / "corpus"
    if not (out / "corpus.jsonl").is_file():
        corpus_stage.run(corpus_stage.CorpusConfig(input=cfg.corpus, out=out))
    return out / "corpus.jsonl"


def build_start(cfg: RetrievalAblationConfig, shape: init_scratch.ScratchShape) -> Path:
    """The pre-trained character-only start, built once: ``OUT/start/scratch`` then ``OUT/start/pretrain/final``.

    An interrupted pre-training resumes from its checkpoint.
    """
    if cfg.start is not None:
        return cfg.start
    final = cfg.out / "start" / "pretrain" / "final"
    if final.is_dir():
        return final
    scratch = cfg.out / "start" / "scratch"
    if not scratch.is_dir():
        init_scratch.init_scratch(init_scratch.ScratchInputs(out=scratch, corpus=cfg.corpus), shape)
    run = cfg.out / "start" / "pretrain"
    pre = pretrain.PretrainConfig(
        out=run,
        resume=(run / "checkpoint.pt").is_file(),
        lr=cfg.start_lr,
        batch_size=cfg.start_batch_size,
        max_length=shape.max_position_embeddings,
        max_steps=cfg.start_steps,
        warmup_proportion=0.06,
        checkpoint_every=max(1, cfg.start_steps // 8),
        device=cfg.device,
        seed=0,
    )
    pretrain.run(pre, pretrain.PretrainInputs(model=scratch, corpus=corpus_file(cfg)))
    return final


def pairs_folder(cfg: RetrievalAblationConfig) -> Path:
    """The folder of ``training.pairs`` on ``--corpus`` (ict + heading, BM25 negatives), made on first use."""
    out = cfg.out / "pairs"
    if not (out / "pairs.json").is_file():
        pairs.run(PairsConfig(corpus=cfg.corpus, out=out))
    return out


def kb_lexicon(cfg: RetrievalAblationConfig) -> Path:
    """``training.build_lexicon`` (jieba, the shipped stopwords) on the start's corpus, once."""
    out = cfg.out / "kb-lexicon"
    if not (out / "lexicon.txt").is_file():
        build_lexicon.run(
            build_lexicon.LexiconConfig(corpus=corpus_file(cfg), out=out, stopwords=STOPWORDS, segmenter="jieba")
        )
    return out / "lexicon.txt"


def fused_model(cfg: RetrievalAblationConfig, arm: Arm, start: Path, seed: int, out: Path) -> Path:
    """``merge_bge`` from the start: the arm's word stream (``--init bge``: embedding exactly as the start)."""
    if not out.is_dir():
        lexicon = kb_lexicon(cfg) if arm.kb_lexicon else cfg.lexicon
        merge_bge.run(
            merge_bge.MergeConfig(
                bge=str(start),
                lexicon=lexicon,
                fusion=arm.fusion,
                seed=seed,
                init=arm.init,
                num_word_layers=arm.num_word_layers or cfg.num_word_layers,
                late_fusion=arm.late_fusion,
                out=out,
            )
        )
    return out


@dataclass(frozen=True)
class Pairs:
    """``training.pairs``' train and dev examples, read once and shared by every arm."""

    train: list[contrastive.Example]
    dev: list[contrastive.Example]

    @classmethod
    def read(cls, folder: Path, train_group_size: int) -> Pairs:
        return cls(
            contrastive.read_examples(folder / "train.jsonl", train_group_size - 1),
            contrastive.read_examples(folder / "dev.jsonl", 0),
        )


def train_arm(cfg: RetrievalAblationConfig, arm: Arm, model_dir: Path, seed: int, run_dir: Path, data: Pairs) -> Path:
    """Contrastive training of ``model_dir`` with the shared budget (two phases for ``word_warmup``).

    The pairs are read once for every arm (``data``), so this calls the stage's training function, not its
    :func:`training.contrastive.run`, which reads them from files.
    """
    from chatchat_policybert.model.loading import save_model_dir

    warm = round(cfg.steps * arm.word_warmup)
    phases = (
        [("warm", warm, True), ("joint", cfg.steps - warm, False)] if warm else [("train", cfg.steps, arm.freeze_chars)]
    )
    for name, steps, freeze in phases:
        out = run_dir / name
        if (out / "final").is_dir():
            model_dir = out / "final"
            continue
        settings = contrastive.ContrastiveConfig(
            out=out,
            resume=(out / "checkpoint.pt").is_file(),
            lr=cfg.lr,
            max_steps=steps,
            batch_size=cfg.batch_size,
            train_group_size=cfg.train_group_size,
            temperature=cfg.temperature,
            max_length=cfg.max_length,
            freeze_chars=freeze,
            freeze_piece_embeddings=cfg.freeze_piece_embeddings,
            precision=cfg.precision,
            seed=seed,
            device=cfg.device,
            checkpoint_every=max(1, steps // 4),
            fusion_scale_lr=cfg.fusion_scale_lr * arm.scale_lr_factor if arm.fusion else None,
        )
        model, tokenizer = contrastive.load_start_model(model_dir)
        # No dev pairs inside training: each arm is scored once, after it, by dev_scores and the question sets.
        contrastive.contrastive(model, tokenizer, data.train, [], settings)
        model_dir = save_model_dir(model, tokenizer, out / "final")
    return model_dir


def _autocast(cfg: RetrievalAblationConfig):
    """The run's encoding precision: bf16 autocast (weights stay float32) or nothing."""
    import torch

    return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def encoding_dtype(cfg: RetrievalAblationConfig) -> str:
    """``PolicyBertEmbeddings``' dtype for ``--precision``."""
    return "bfloat16" if cfg.precision == "bf16" else "float32"


def dev_scores(cfg: RetrievalAblationConfig, model_dir: Path, data: Pairs) -> dict:
    """``training.contrastive``'s own dev ranking (every dev pos and neg) of ``model_dir``: means and per-query MRR@10.

    Per query, so that the arms can be compared query by query on the held-out documents, the
    split the recipe's default is chosen on (the questions are kept for the final check). Empty
    without ``--dev-pool``.
    """
    import torch

    if not cfg.dev_pool:
        return {}
    model, tokenizer = contrastive.load_start_model(model_dir)
    settings = contrastive.ContrastiveConfig(out=cfg.out, temperature=cfg.temperature, max_length=cfg.max_length)
    task = contrastive.ContrastiveTask(tokenizer, [], data.dev, settings, cfg.max_length)
    with torch.no_grad(), _autocast(cfg):
        per_query = task.rank_dev(model.to(cfg.device).eval())
    return {
        **{key: round(float(np.mean(values)), 4) for key, values in per_query.items() if key != "loss"},
        MRR: per_query["mrr@10"],
    }


def dev_bm25(data: Pairs) -> float:
    """BM25's MRR@10 on the same dev pool and queries as :func:`dev_scores` (no instruction: BM25 reads words)."""
    dev = data.dev
    pool = list(dict.fromkeys(text for e in dev for text in (*e.pos, *e.neg)))
    position = {text: i for i, text in enumerate(pool)}
    bm25 = Bm25([Chunk(str(i), text, str(i)) for i, text in enumerate(pool)], 10, get_analyzer(NEW_DEPLOYMENT))
    return float(
        np.mean([mrr_at_k(rank_by_score(bm25.scores(e.query), 10), {position[t] for t in e.pos}, 10) for e in dev])
    )


METRICS = (MRR, "R@5")
"""The per-question scores kept and tabled for every question set."""


def question_set_name(path: Path) -> str:
    """A question file's name in the tables: its stem (``policy_questions`` for the shipped 49)."""
    return Path(path).stem


@dataclass(frozen=True)
class QuestionSet:
    """One question set over the chunks: its questions and BM25 alone on them."""

    name: str
    path: Path
    queries: list
    bm25: dict[str, float]


class QueriesAtOnce:
    """A ``PolicyBertEmbeddings`` whose queries are embedded in one batched pass (``encode_queries``, longest first
    in token-budget batches) the first time one is asked for, not one forward pass per question: on a loaded CPU
    the 380 questions of the e5 ablation took ~9 min one by one. Documents go through unchanged."""

    def __init__(self, embeddings, queries: list[str]):
        self._embeddings, self._queries = embeddings, queries
        self._vectors: dict[str, np.ndarray] | None = None

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._embeddings.embed_documents(texts)

    def embed_query(self, text: str) -> np.ndarray:
        if self._vectors is None:
            self._vectors = dict(zip(self._queries, self._embeddings.encode_queries(self._queries)))
        return self._vectors[text]


class QuestionScorer:
    """Scores models on every ``--questions`` file and on the dev pairs over the corpus's Chatchat chunks.

    The chunks and BM25 are made once (a temporary root, no index). Each model embeds the chunks
    once (its directory's pooling and document prompt, ``--precision``) and every question set is
    ranked from those vectors; with ``chatchat`` in ``--retrievers``, each question file also gets a
    run of ``chatchat-policybert eval --retrievers chatchat`` (a root of its own, ``kb -r``, and
    Chatchat's ``search_docs``).
    """

    KS = [1, 5, 10]

    def __init__(self, cfg: RetrievalAblationConfig, dev_pairs: Path):
        if cfg.questions is None and Path(cfg.corpus).resolve() != CORPUS_CSV.resolve():
            raise InputError("--questions is required when --corpus is not the shipped corpus")
        self.cfg = cfg
        self.corpus = load_corpus(cfg.corpus)
        self.files = list(cfg.questions or [QUESTIONS])
        with tempfile.TemporaryDirectory(prefix="policybert-ablate-") as tmp:
            root = Path(tmp) / "root"
            self.chunks = load_chunks(root, prepare_root(root, self.corpus, None, build_index=False), self.corpus)
        bm25 = Bm25(self.chunks, DEPTH, get_analyzer(NEW_DEPLOYMENT))
        named = [(question_set_name(f), f, load_questions(f, self.corpus)) for f in self.files]
        named.append((DEV_PAIRS, dev_pairs, pair_queries(dev_pairs, self.chunks)))
        self.sets = [
            QuestionSet(name, path, queries, scoring.evaluate_retriever(bm25, queries, self.chunks, self.KS).metrics)
            for name, path, queries in named
        ]

    @property
    def questions(self) -> list:
        """Every question of the ``--questions`` files (not the dev pairs)."""
        return [q for qs in self.sets if qs.name != DEV_PAIRS for q in qs.queries]

    def score(self, label: str, model_dir: Path, out: Path) -> dict[str, dict[str, dict]]:
        """``{set: {retriever: {"metrics": …, "queries": […]}}}`` for dense (and chatchat), cached in ``out``."""
        if out.is_file():  # scored by an earlier invocation
            return json.loads(out.read_text(encoding="utf-8"))["results"]
        from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

        embeddings = PolicyBertEmbeddings(model_dir, device=self.cfg.device, dtype=encoding_dtype(self.cfg))
        texts = list(dict.fromkeys(q.text for qs in self.sets for q in qs.queries))
        dense = Dense(f"dense:{label}", QueriesAtOnce(embeddings, texts), self.chunks, DEPTH)
        results: dict[str, dict[str, dict]] = {}
        for qs in self.sets:
            run = scoring.evaluate_retriever(dense, qs.queries, self.chunks, self.KS)
            results[qs.name] = {run.name: {"metrics": run.metrics, "queries": run.queries}}
        if "chatchat" in self.cfg.retrievers:
            for qs in self.sets:
                if qs.name == DEV_PAIRS:
                    continue
                config = evaluate.EvalConfig(
                    model=[f"{label}={model_dir}"],
                    retrievers="chatchat",
                    device=self.cfg.device,
                    corpus=self.cfg.corpus,
                    questions=qs.path,
                    out=out.with_name(f"chatchat-{qs.name}.json"),
                )
                results[qs.name].update(evaluate.evaluate(config).payload["results"])
        write_json({"results": results}, out)
        return results


def word_stream(cfg: RetrievalAblationConfig, model_dir: Path, texts: list[str]) -> dict:
    """How far the trained word stream moves the model: empty without words.

    ``fusion_scales``: the trained ``s``; ``word_change``: per character layer, ‖H − H_chars‖ /
    ‖H_chars‖ over the texts' real tokens, H with the word stream and H_chars without (without
    its word inputs PolicyBERT is exactly its character encoder, so this is 0 at ``--init bge``);
    ``vector_change``: the mean of 1 − cos between the served vector (the directory's pooling) with
    and without the words — what retrieval sees of the word stream.
    """
    import torch

    from chatchat_policybert.model.embeddings import sentence_vectors

    model, tokenizer = contrastive.load_start_model(model_dir)
    if tokenizer.lexicon is None:
        return {"fusion_scales": [], "word_change": [], "vector_change": None}
    batch = dict(tokenizer([tokenizer.document_prompt + t for t in texts], max_length=cfg.max_length))
    chars_only = {k: v for k, v in batch.items() if not k.startswith("word")}
    mask = batch["attention_mask"].bool()
    model.eval()
    with torch.no_grad(), _autocast(cfg):
        fused = [h.float() for h in model(**batch, output_hidden_states=True).hidden_states[1:]]
        plain = [h.float() for h in model(**chars_only, output_hidden_states=True).hidden_states[1:]]
        cosine = (
            sentence_vectors(model, batch, tokenizer.pooling) * sentence_vectors(model, chars_only, tokenizer.pooling)
        ).sum(-1)
    return {
        "fusion_scales": [round(float(v), 4) for v in model.fusion_scales.detach()],
        "word_change": [round(float((f - p)[mask].norm() / p[mask].norm()), 4) for f, p in zip(fused, plain)],
        "vector_change": float((1 - cosine.float()).mean()),
    }


def word_coverage(lexicon: Lexicon, scorer: QuestionScorer) -> dict[str, float]:
    """Do questions and their documents' chunks share lexicon words at all?

    ``questions``/``chunks`` with a word: share of texts matching at least one word; ``shared``:
    share of questions with a matched word that also occurs in a chunk of a relevant document.
    """
    chunk_words: dict[str, set[int]] = {}
    for chunk in scorer.chunks:
        chunk_words.setdefault(chunk.group, set()).update(int(w) for w in lexicon.find(chunk.text)[:, 0])
    questions = scorer.questions
    question_words = [set(int(w) for w in lexicon.find(q.text)[:, 0]) for q in questions]
    shared = [
        bool(words & set().union(*(chunk_words.get(g, set()) for g in q.gains)))
        for q, words in zip(questions, question_words)
    ]
    return {
        "questions with a word": round(float(np.mean([bool(w) for w in question_words])), 3),
        "words per question": round(float(np.mean([len(w) for w in question_words])), 2),
        "chunks with a word": round(float(np.mean([len(lexicon.find(c.text)) > 0 for c in scorer.chunks])), 3),
        "questions sharing a word with their document": round(float(np.mean(shared)), 3),
    }


def run_result(cfg: RetrievalAblationConfig, name: str, seed: int) -> Path:
    """Where a finished run of ``name`` with ``seed`` keeps its scores (its presence means: done)."""
    return cfg.out / "runs" / f"{name}-seed{seed}" / "result.json"


def run_arm(
    cfg: RetrievalAblationConfig, name: str, seed: int, start: Path, data: Pairs, scorer: QuestionScorer
) -> dict:
    """One arm and seed, end to end; its ``result.json`` makes a re-run skip it."""
    arm = ARMS[name]
    result_file = run_result(cfg, name, seed)
    run_dir = result_file.parent
    if result_file.is_file():
        return json.loads(result_file.read_text(encoding="utf-8"))
    began = time.time()
    model_dir = fused_model(cfg, arm, start, seed, run_dir / "merged") if arm.fusion else start
    if arm.trains:
        model_dir = train_arm(cfg, arm, model_dir, seed, run_dir, data)
    train_minutes = (time.time() - began) / 60
    began = time.time()
    dev = dev_scores(cfg, model_dir, data)
    questions = scorer.score(name, model_dir, run_dir / "questions.json")
    result = {
        "arm": name,
        "seed": seed,
        "model": str(model_dir),
        "settings": asdict(arm),
        "train_minutes": round(train_minutes, 2),
        "score_minutes": round((time.time() - began) / 60, 2),
        "dev": dev,
        **word_stream(cfg, model_dir, [c.text for c in scorer.chunks[:32]]),
        "questions": {
            set_name: {
                retriever: {
                    "metrics": r["metrics"],
                    "ids": [q["id"] for q in r["queries"]],
                    **{metric: [q[metric] for q in r["queries"]] for metric in METRICS},
                }
                for retriever, r in by_retriever.items()
            }
            for set_name, by_retriever in questions.items()
        },
    }
    write_json(result, result_file)
    return result


def embedding_speed(
    models: dict[str, Path], texts: list[str], cfg: RetrievalAblationConfig, cache: Path, reps: int = 3
) -> dict[str, float]:
    """Each model's time to embed ``texts`` relative to the first model's (interleaved repetitions, best of ``reps``).

    Kept in ``cache`` for the same models, so that re-tabling a finished ablation does not measure
    again; delete it to measure afresh (on a quiet machine: the ratios are only as good as the run).
    """
    key = {name: str(path) for name, path in models.items()}
    if cache.is_file():
        saved = json.loads(cache.read_text(encoding="utf-8"))
        if saved["models"] == key:
            return saved["speed"]
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

    loaded = {
        name: PolicyBertEmbeddings(path, device=cfg.device, dtype=encoding_dtype(cfg)) for name, path in models.items()
    }
    for embeddings in loaded.values():  # one untimed pass each: first-call allocations are no model's cost
        embeddings.embed_documents(texts[:8])
    best = {name: float("inf") for name in models}
    for _ in range(reps):
        for name, embeddings in loaded.items():
            began = time.perf_counter()
            embeddings.embed_documents(texts)
            best[name] = min(best[name], time.perf_counter() - began)
    first = best[next(iter(models))]
    speed = {name: round(first / seconds, 3) for name, seconds in best.items()}
    write_json({"models": key, "speed": speed}, cache)
    return speed


def _row_key(retriever: str) -> str:
    """``dense:ARM`` / ``chatchat(thr=…)`` / ``bm25`` → dense / chatchat / bm25."""
    return retriever.split(":")[0].split("(")[0]


REFERENCES = ("base", COMPETITOR)
"""What every arm is compared with on every question set: the untuned start, and plain fine-tuning of it."""


def _per_question(runs: list[dict], set_name: str) -> dict[str, dict[str, np.ndarray]]:
    """``{kind: {metric: per-question scores averaged over the runs (seeds)}}`` of one question set."""
    kinds: dict[str, dict[str, np.ndarray]] = {}
    for retriever in runs[0]["questions"][set_name]:
        kind = _row_key(retriever)
        kinds[kind] = {
            metric: np.mean([r["questions"][set_name][retriever][metric] for r in runs], axis=0) for metric in METRICS
        }
    return kinds


def summarise(results: list[dict], arms: list[str], resamples: int = 1000) -> dict:
    """Per arm: what is not a question set's: mean ± sd over seeds of the dev-pool MRR@10 (with ``--dev-pool``; its
    per-query scores averaged over seeds and bootstrapped vs ``base+ft``), the fusion scales, the word stream's
    change to the served vector, training minutes."""
    table: dict = {}
    dev: dict[str, np.ndarray] = {}
    for name in arms:
        runs = [r for r in results if r["arm"] == name]
        row: dict = {"seeds": len(runs), "train_minutes": statistics.mean(r["train_minutes"] for r in runs)}
        if all(r["dev"] for r in runs):
            row["dev " + MRR] = _mean_sd([r["dev"]["mrr@10"] for r in runs])
            dev[name] = np.mean([r["dev"][MRR] for r in runs], axis=0)
        scales = [s for r in runs for s in r["fusion_scales"]]
        row["mean |s|"] = round(float(np.mean(np.abs(scales))), 4) if scales else None
        row["1 − cos, vector without words"] = (
            float(f"{np.mean([r['vector_change'] for r in runs]):.3g}") if runs[0]["word_change"] else None
        )
        table[name] = row
    for name, scores in dev.items():
        if name != COMPETITOR and COMPETITOR in dev:
            low, high = paired_bootstrap_interval(scores, dev[COMPETITOR], resamples)
            table[name][f"Δdev vs {COMPETITOR}"] = (
                round(float(np.mean(scores - dev[COMPETITOR])), 4),
                round(low, 4),
                round(high, 4),
            )
    return table


def summarise_sets(results: list[dict], arms: list[str], resamples: int = 1000) -> dict:
    """Per question set, per arm: mean ± sd over seeds of MRR@10 and R@5 (each retriever scored), and the paired
    bootstrap delta of each vs ``base`` and vs ``base+ft`` over the questions, each question's score averaged over
    seeds first."""
    sets: dict = {}
    for set_name in results[0]["questions"]:
        rows: dict = {}
        scores = {name: _per_question([r for r in results if r["arm"] == name], set_name) for name in arms}
        for name in arms:
            runs = [r for r in results if r["arm"] == name]
            row: dict = {"seeds": len(runs)}
            for retriever in runs[0]["questions"][set_name]:
                kind = _row_key(retriever)
                for metric in METRICS:
                    row[f"{kind} {metric}"] = _mean_sd(
                        [r["questions"][set_name][retriever]["metrics"][metric] for r in runs]
                    )
            for reference in REFERENCES:
                if reference == name or reference not in scores:
                    continue
                for kind, by_metric in scores[name].items():
                    if kind not in scores[reference]:
                        continue
                    for metric, ours in by_metric.items():
                        theirs = scores[reference][kind][metric]
                        low, high = paired_bootstrap_interval(ours, theirs, resamples)
                        row[f"Δ{kind} {metric} vs {reference}"] = (
                            round(float(np.mean(ours - theirs)), 4),
                            round(low, 4),
                            round(high, 4),
                        )
            rows[name] = row
        sets[set_name] = rows
    return sets


def _run_result(run: dict, set_name: str, retriever: str) -> RunResult:
    """One run's stored per-question scores of one set as the evaluation's :class:`RunResult`."""
    scored = run["questions"][set_name][retriever]
    return RunResult(
        f"{run['arm']}-seed{run['seed']}",
        {metric: scored["metrics"][metric] for metric in METRICS},
        [{"id": i, **{m: scored[m][n] for m in METRICS}} for n, i in enumerate(scored["ids"])],
    )


def gate_decisions(results: list[dict], gate_set: str, resamples: int = 1000) -> list[dict]:
    """What the gate of 0.1.0's inverse-cloze ``tune`` (removed in 0.2.0) would decide for each trained run, the
    deployed model being the untuned start (``base``).

    The rule (:func:`chatchat_policybert.evaluation.gate_rule.gate_failure`) as that gate applied it: MRR@10 must
    rise on the dev pairs and, with ``--questions``, must not fall there. Judged (i) on the dev pairs alone (what an
    unlabelled knowledge base gets) and (ii) with ``gate_set`` (the first ``--questions`` file) as ``--questions``.
    Beside each: the deltas vs ``base`` on every other question set, which chose nothing — where
    (i) installs a model those sets call worse, the dev pairs misled the gate.
    """
    base = next((r for r in results if r["arm"] == "base"), None)
    if base is None:
        return []
    held_out = [s for s in base["questions"] if s not in (DEV_PAIRS, gate_set)]
    rows = []
    for run in results:
        if run["arm"] == "base":
            continue
        for retriever in run["questions"][DEV_PAIRS]:
            kind = _row_key(retriever)
            theirs = next((r for r in base["questions"][DEV_PAIRS] if _row_key(r) == kind), None)
            if theirs is None:
                continue
            dev = compare_runs(_run_result(run, DEV_PAIRS, retriever), _run_result(base, DEV_PAIRS, theirs), resamples)
            dev_failure = gate_failure(dev, must_rise=True, baseline="the base's")
            row = {
                "arm": run["arm"],
                "seed": run["seed"],
                "retriever": kind,
                f"Δ {DEV_PAIRS}": _delta(dev),
                "install on dev pairs alone": dev_failure is None,
                "reasons": [f"{DEV_PAIRS}: {dev_failure}"] if dev_failure else [],
            }
            questions_failure = None
            for set_name in (gate_set, *held_out):
                ours = next((r for r in run["questions"][set_name] if _row_key(r) == kind), None)
                base_key = next((r for r in base["questions"][set_name] if _row_key(r) == kind), None)
                if ours is None or base_key is None:
                    continue
                deltas = compare_runs(
                    _run_result(run, set_name, ours), _run_result(base, set_name, base_key), resamples
                )
                row[f"Δ {set_name}"] = _delta(deltas)
                if set_name == gate_set:
                    questions_failure = gate_failure(deltas, baseline="the base's")
                    if questions_failure:
                        row["reasons"].append(f"{gate_set}: {questions_failure}")
            row[f"install with {gate_set}"] = dev_failure is None and questions_failure is None
            held = [row[f"Δ {s}"][0] for s in held_out if f"Δ {s}" in row]
            row["dev pairs misled"] = bool(row["install on dev pairs alone"] and held and np.mean(held) < 0)
            rows.append(row)
    return rows


def _delta(deltas: list) -> tuple[float, float, float]:
    """MRR@10's delta and its 95 % interval from :func:`compare_runs`' list."""
    mrr = next(d for d in deltas if d.metric == MRR)
    return round(mrr.delta, 4), round(mrr.low, 4), round(mrr.high, 4)


def verdict(table: dict, sets: dict) -> str:
    """The word stream's verdict, by a rule fixed before the runs: chosen on dev, checked on the questions.

    The fused arm with the best mean dev MRR@10 is the candidate default (the dev pool's with
    ``--dev-pool``, else the dev pairs' over the chunks, dense); it beats ``base+ft`` only if its
    paired 95 % interval there lies above 0. The question sets are not used for the choice: their
    deltas are reported as the independent check.
    """
    pool = all("dev " + MRR in row for row in table.values())
    fused = [name for name in table if ARMS[name].fusion]
    if not fused or COMPETITOR not in table:
        return f"verdict: no fused arm was compared with {COMPETITOR}\n"
    if pool:
        score = {name: table[name]["dev " + MRR][0] for name in fused}
        chosen = {name: table[name][f"Δdev vs {COMPETITOR}"] for name in fused}
        where = "the dev pool"
    else:
        score = {name: sets[DEV_PAIRS][name][f"dense {MRR}"][0] for name in fused}
        chosen = {name: sets[DEV_PAIRS][name][f"Δdense {MRR} vs {COMPETITOR}"] for name in fused}
        where = "the dev pairs (dense, over the chunks)"
    best = max(fused, key=score.__getitem__)
    delta, low, high = chosen[best]
    checks = "; ".join(
        f"{set_name} {column.split()[0][1:]} {value[0]:+.4f} [{value[1]:+.4f}, {value[2]:+.4f}] vs {reference}"
        for set_name, rows in sets.items()
        if set_name != DEV_PAIRS
        for reference in REFERENCES
        for column, value in rows[best].items()
        if column.startswith("Δ") and column.endswith(f"{MRR} vs {reference}")
    )
    won = "beats" if low > 0 else "does not beat"
    return (
        f"verdict: best fused arm on {where} is {best} (Δ {delta:+.4f} [{low:+.4f}, {high:+.4f}] vs {COMPETITOR}): "
        f"it {won} {COMPETITOR} there; on the question sets, not used for the choice (MRR@10): "
        f"{checks or 'not scored'}\n"
    )


def _group_by(values: dict[str, str]) -> dict[str, list[str]]:
    """Names grouped by their value, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name, value in values.items():
        groups.setdefault(value, []).append(name)
    return groups


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return round(statistics.mean(values), 4), round(statistics.stdev(values), 4) if len(values) > 1 else 0.0


def _cell(value: object) -> str:
    if isinstance(value, tuple) and len(value) == 2:
        return f"{value[0]:.4f} ± {value[1]:.4f}"
    if isinstance(value, tuple):
        return f"{value[0]:+.4f} [{value[1]:+.4f}, {value[2]:+.4f}]"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "–" if value is None else f"{value}"


def _grid(rows: dict[str, dict], first: str, skip: tuple[str, ...] = ()) -> list[str]:
    columns = [c for c in dict.fromkeys(c for row in rows.values() for c in row) if c not in skip]
    lines = [
        f"| {first} | " + " | ".join(c.replace("|", "\\|") for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    lines += [f"| {name} | " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for name, row in rows.items()]
    return lines


def markdown(table: dict, bm25: dict[str, float], speed: dict[str, float]) -> str:
    """The per-arm table (what is not a question set's): dev pool, word stream, speed, training time."""
    rows = {
        name: {**{k: v for k, v in row.items() if k != "train_minutes"}, "speed vs start": speed.get(name)}
        | {"train min": round(row["train_minutes"], 1)}
        for name, row in table.items()
    }
    lines = _grid(rows, "arm")
    if "dev" in bm25:
        columns = list(next(iter(rows.values())))
        lines.append(
            "| BM25 alone | " + " | ".join(f"{bm25['dev']:.4f}" if c == "dev " + MRR else "–" for c in columns) + " |"
        )
    return "\n".join(lines) + "\n"


def sets_markdown(sets: dict, bm25: dict[str, dict[str, float]], sizes: dict[str, int]) -> str:
    """One table per question set: each arm's MRR@10 and R@5 and its deltas vs ``base`` and ``base+ft``; BM25
    alone under it."""
    text = []
    for set_name, rows in sets.items():
        lines = _grid(rows, "arm")
        columns = list(dict.fromkeys(c for row in rows.values() for c in row))
        lines.append(
            "| BM25 alone | "
            + " | ".join(
                f"{bm25[set_name][c.split()[-1]]:.4f}" if not c.startswith("Δ") and c.endswith(METRICS) else "–"
                for c in columns
            )
            + " |"
        )
        text.append(f"### {set_name} ({sizes[set_name]} questions)\n\n" + "\n".join(lines) + "\n")
    return "\n".join(text)


def gate_markdown(rows: list[dict], gate_set: str) -> str:
    """The gate decisions, a row per trained run and retriever."""
    if not rows:
        return "gate decisions: none (no base run to gate against, or no trained run)\n"
    grid = {f"{r['arm']} seed {r['seed']} ({r['retriever']})": r for r in rows}
    lines = _grid(grid, "run", skip=("arm", "seed", "retriever", "reasons"))
    return (
        f"gate decisions vs base (tune's rule: MRR@10 up on the {DEV_PAIRS}, not down on --questions = {gate_set}):\n\n"
        + "\n".join(lines)
        + "\n"
    )


def coverage_table(coverage: dict[str, dict[str, float]]) -> str:
    """Lexicon match coverage of the questions and chunks, one row per lexicon."""
    columns = list(next(iter(coverage.values())))
    return (
        "| lexicon | "
        + " | ".join(columns)
        + " |\n|---|"
        + "---|" * len(columns)
        + "\n"
        + "".join(f"| {name} | " + " | ".join(str(v) for v in row.values()) + " |\n" for name, row in coverage.items())
    )


def plot(sets: dict, bm25: dict[str, dict[str, float]], path: Path) -> None:
    """Bars of each arm's MRR@10 (mean, sd as error bars) per question set and retriever, BM25 alone dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (set_name, column)
        for set_name, rows in sets.items()
        for column in next(iter(rows.values()))
        if column.endswith(MRR) and not column.startswith("Δ")
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for axis, (set_name, column) in zip(axes[0], panels):
        rows = sets[set_name]
        names = list(rows)
        axis.bar(names, [rows[n][column][0] for n in names], yerr=[rows[n][column][1] for n in names], capsize=3)
        axis.axhline(bm25[set_name][MRR], color="#c44", linestyle="--", label="BM25 alone")
        axis.legend(loc="lower left", fontsize=8)
        axis.set_title(f"{set_name}: {column}", fontsize=9)
        axis.tick_params(axis="x", rotation=45, labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def bf16_check(cfg: RetrievalAblationConfig, start: Path, scorer: QuestionScorer, texts: int = 32) -> dict | None:
    """With ``--precision bf16``: the least cosine between the start's bf16 and fp32 vectors over chunks and
    questions (the project's bar is 0.999), kept in ``OUT/bf16_check.json``."""
    if cfg.precision != "bf16":
        return None
    cache = cfg.out / "bf16_check.json"
    if cache.is_file():
        return json.loads(cache.read_text(encoding="utf-8"))
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

    chunks = [c.text for c in scorer.chunks[:texts]]
    questions = [q.text for q in scorer.questions[:texts]]
    vectors = {}
    for dtype in ("float32", "bfloat16"):
        embeddings = PolicyBertEmbeddings(start, device=cfg.device, dtype=dtype)
        vectors[dtype] = np.concatenate([embeddings.encode_corpus(chunks), embeddings.encode_queries(questions)])
    cosine = (vectors["float32"] * vectors["bfloat16"]).sum(axis=1)  # both unit vectors
    check = {"texts": len(cosine), "min_cosine": round(float(cosine.min()), 6), "bar": 0.999}
    write_json(check, cache)
    return check


def served_as(models: dict[str, Path]) -> dict[str, dict[str, str | None]]:
    """Each model directory's pooling and prompts, as ``PolicyBertEmbeddings`` and training read them: the check that
    every arm (merged, trained, saved) kept its start's."""
    from chatchat_policybert.model.tokenization_policybert import read_pooling, read_prompts

    served = {}
    for name, path in models.items():
        query, document = read_prompts(path)
        served[name] = {"pooling": read_pooling(path), "query prompt": query, "document prompt": document}
    return served


def run(cfg: RetrievalAblationConfig, shape: init_scratch.ScratchShape) -> dict:
    """Every arm with every seed (a finished run is read back, not run again); writes ``OUT/results.json``,
    ``results.md`` and ``results.png``; returns what ``results.json`` holds."""
    import torch

    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    began = time.time()
    start = build_start(cfg, shape)
    folder = pairs_folder(cfg)
    data = Pairs.read(folder, cfg.train_group_size)
    scorer = QuestionScorer(cfg, folder / "dev.jsonl")
    precision = bf16_check(cfg, start, scorer)
    if precision and precision["min_cosine"] < precision["bar"]:
        raise InputError(
            f"--precision bf16: the start's bf16 vectors are {precision['min_cosine']} cosine from fp32, below "
            f"{precision['bar']}: use --precision fp32"
        )
    results = []
    for seed in cfg.seeds:
        for name in cfg.arms:
            if not (ARMS[name].trains or seed == cfg.seeds[0]):  # an untrained arm is the same model for every seed
                continue
            if cfg.table_only and not run_result(cfg, name, seed).is_file():
                print(f"== arm {name}, seed {seed}: not run, left out of the table (--table-only) ==")
                continue
            print(f"== arm {name}, seed {seed} ==", flush=True)
            results.append(run_arm(cfg, name, seed, start, data, scorer))
    if cfg.table_only and not results:
        raise InputError(f"--table-only: no finished run of --arms {' '.join(cfg.arms)} in {cfg.out / 'runs'}")
    cfg.arms = [name for name in cfg.arms if any(r["arm"] == name for r in results)]
    table = summarise(results, cfg.arms)
    sets = summarise_sets(results, cfg.arms)
    gate_set = question_set_name(scorer.files[0])
    gates = gate_decisions(results, gate_set)
    first = {r["arm"]: r for r in reversed(results)}
    bm25_sets = {qs.name: {m: round(qs.bm25[m], 4) for m in METRICS} for qs in scorer.sets}
    bm25 = {"dev": round(dev_bm25(data), 4)} if cfg.dev_pool else {}
    speed: dict[str, float] = {}
    if cfg.speed_texts:
        with_words = {name: Path(r["model"]) for name, r in first.items()}
        texts = [chunk.text for chunk in scorer.chunks[: cfg.speed_texts]]
        speed = embedding_speed({"start": start, **with_words}, texts, cfg, cfg.out / "speed.json")
    coverage = {"--lexicon": word_coverage(Lexicon.load(cfg.lexicon), scorer)}
    if any(ARMS[name].kb_lexicon for name in cfg.arms):
        coverage["KB lexicon"] = word_coverage(Lexicon.load(kb_lexicon(cfg)), scorer)
    served = served_as({"start": start, **{f"{r['arm']}-seed{r['seed']}": Path(r["model"]) for r in results}})
    seeds_done = {name: sorted(r["seed"] for r in results if r["arm"] == name) for name in cfg.arms}
    text = (
        sets_markdown(sets, bm25_sets, {qs.name: len(qs.queries) for qs in scorer.sets})
        + "\n"
        + verdict(table, sets)
        + "\n"
        + gate_markdown(gates, gate_set)
        + "\n"
        + markdown(table, bm25, speed)
        + "\n"
        + coverage_table(coverage)
        + "\nserved as (pooling, query prompt, document prompt): "
        + "; ".join(
            f"{', '.join(names)}: {key}"
            for key, names in _group_by({name: repr(tuple(v.values())) for name, v in served.items()}).items()
        )
        + "\n"
    )
    text += (
        f"\nmean ± sd over the seeds each arm finished ({seeds_done}); Δ: paired bootstrap (1000) over questions of "
        f"the seed-averaged scores vs {' and vs '.join(REFERENCES)}, 95 % interval; precision {cfg.precision}"
        + (f" (bf16 vs fp32 vectors of the start: min cosine {precision['min_cosine']})" if precision else "")
        + ("; speed: embedding time of the start ÷ the arm's, same run" if speed else "")
        + f"; {(time.time() - began) / 60:.1f} min this invocation\n"
    )
    summary = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "start_shape": asdict(shape),
        "table": table,
        "sets": sets,
        "gate": gates,
        "bm25": {"dev pool": bm25.get("dev"), **bm25_sets},
        "bf16_check": precision,
        "speed": speed,
        "coverage": coverage,
        "seeds_done": seeds_done,
        "served_as": served,
        "runs": results,
    }
    write_json(summary, cfg.out / "results.json")
    (cfg.out / "results.md").write_text(text, encoding="utf-8")
    plot(sets, bm25_sets, cfg.out / "results.png")
    print(text)
    print(f"wrote {cfg.out / 'results.md'}, {cfg.out / 'results.png'}, {cfg.out / 'results.json'}")
    return summary


def main(argv: list[str] | None = None) -> None:
    run(
        *parse_flags(
            RetrievalAblationConfig,
            argv,
            "python -m training.ablate --task retrieval",
            __doc__.split("\n\n")[0],
            extra=(init_scratch.ScratchShape,),
        )
    )

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
of the dev pool, and BM25 on that pool) and on ``--questions`` over the corpus's Chatchat chunks,
dense and through Chatchat's own ``search_docs`` (the ensemble the RAG tab uses; a temporary root
and ``kb -r`` per model), with BM25 alone as a row. Beside each arm: its fusion scales after
training, how far the word stream moves the character states (per layer, ‖H − H_chars‖ / ‖H_chars‖
with and without the words), and its embedding speed against the start (same run, same texts);
under the table, how often questions and chunks match lexicon words at all, for both lexicons. ``OUT/results.md``
holds the table (mean ± sd over seeds; the paired-bootstrap delta of each arm vs ``base+ft`` over
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
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation import evaluate, scoring
from chatchat_policybert.evaluation.dataset import load_corpus, load_questions
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks, prepare_root
from chatchat_policybert.evaluation.metrics import mrr_at_k, paired_bootstrap_interval, rank_by_score
from chatchat_policybert.evaluation.retrievers import Bm25, Dense
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
    questions: Path | None = field(
        default=None,
        metadata={"help": "JSONL questions over --corpus (the evaluation's format); None: the shipped ones"},
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
    max_length: int = field(default=256, metadata={"help": "tokens per query or passage"})
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
            seed=seed,
            device=cfg.device,
            checkpoint_every=max(1, steps // 4),
            fusion_scale_lr=cfg.fusion_scale_lr * arm.scale_lr_factor if arm.fusion else None,
        )
        model, tokenizer = contrastive.load_start_model(model_dir)
        contrastive.contrastive(model, tokenizer, data.train, data.dev, settings)
        model_dir = save_model_dir(model, tokenizer, out / "final")
    return model_dir


def dev_scores(cfg: RetrievalAblationConfig, model_dir: Path, data: Pairs) -> dict:
    """``training.contrastive``'s own dev ranking (every dev pos and neg) of ``model_dir``: means and per-query MRR@10.

    Per query, so that the arms can be compared query by query on the held-out documents, the
    split the recipe's default is chosen on (the questions are kept for the final check).
    """
    import torch

    model, tokenizer = contrastive.load_start_model(model_dir)
    settings = contrastive.ContrastiveConfig(out=cfg.out, temperature=cfg.temperature, max_length=cfg.max_length)
    task = contrastive.ContrastiveTask(tokenizer, [], data.dev, settings, cfg.max_length)
    with torch.no_grad():
        per_query = task.rank_dev(model.to(cfg.device))
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


class QuestionScorer:
    """Scores models on ``--questions`` over the corpus's Chatchat chunks, the evaluation's own way.

    The chunks and BM25 are made once (a temporary root, no index); each model gets its dense
    ranking of them and, with ``chatchat`` in ``--retrievers``, a run of ``chatchat-policybert
    eval --retrievers chatchat``: a root of its own, ``kb -r``, and Chatchat's ``search_docs``.
    """

    KS = [1, 5, 10]

    def __init__(self, cfg: RetrievalAblationConfig):
        if cfg.questions is None and Path(cfg.corpus).resolve() != CORPUS_CSV.resolve():
            raise InputError("--questions is required when --corpus is not the shipped corpus")
        self.cfg = cfg
        self.corpus = load_corpus(cfg.corpus)
        self.queries = load_questions(cfg.questions or QUESTIONS, self.corpus)
        with tempfile.TemporaryDirectory(prefix="policybert-ablate-") as tmp:
            root = Path(tmp) / "root"
            self.chunks = load_chunks(root, prepare_root(root, self.corpus, None, build_index=False), self.corpus)
        bm25 = Bm25(self.chunks, DEPTH, get_analyzer(NEW_DEPLOYMENT))
        self.bm25 = scoring.evaluate_retriever(bm25, self.queries, self.chunks, self.KS)

    def score(self, label: str, model_dir: Path, out: Path) -> dict[str, dict]:
        """``{retriever: {"metrics": …, "queries": […]}}`` for dense (and chatchat), cached in ``out``.

        With ``chatchat``, ``chatchat-policybert eval`` ranks dense from the vectors its ``kb -r``
        stored, so the model embeds the chunks once for both rows.
        """
        if out.is_file():  # scored by an earlier invocation
            return json.loads(out.read_text(encoding="utf-8"))["results"]
        if "chatchat" in self.cfg.retrievers:
            config = evaluate.EvalConfig(
                model=[f"{label}={model_dir}"],
                retrievers="dense,chatchat",
                device=self.cfg.device,
                corpus=self.cfg.corpus,
                questions=self.cfg.questions or QUESTIONS,
                out=out,
            )
            return evaluate.evaluate(config).payload["results"]
        from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

        embeddings = PolicyBertEmbeddings(model_dir, device=self.cfg.device)
        dense = scoring.evaluate_retriever(
            Dense(f"dense:{label}", embeddings, self.chunks, DEPTH), self.queries, self.chunks, self.KS
        )
        results = {dense.name: {"metrics": dense.metrics, "queries": dense.queries}}
        write_json({"results": results}, out)
        return results


def word_stream(model_dir: Path, texts: list[str], max_length: int) -> dict:
    """How far the trained word stream moves the model: empty without words.

    ``fusion_scales``: the trained ``s``; ``word_change``: per character layer, ‖H − H_chars‖ /
    ‖H_chars‖ over the texts' real tokens, H with the word stream and H_chars without (without
    its word inputs PolicyBERT is exactly its character encoder, so this is 0 at ``--init bge``);
    ``vector_change``: the mean of 1 − cos between the served vector ([CLS], last layer) with and
    without the words — what retrieval sees of the word stream.
    """
    import torch

    model, tokenizer = contrastive.load_start_model(model_dir)
    if tokenizer.lexicon is None:
        return {"fusion_scales": [], "word_change": [], "vector_change": None}
    batch = dict(tokenizer(texts, max_length=max_length))
    chars_only = {k: v for k, v in batch.items() if not k.startswith("word")}
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        fused = model(**batch, output_hidden_states=True).hidden_states[1:]
        plain = model(**chars_only, output_hidden_states=True).hidden_states[1:]
    cosine = torch.nn.functional.cosine_similarity(fused[-1][:, 0], plain[-1][:, 0], dim=-1)
    return {
        "fusion_scales": [round(float(v), 4) for v in model.fusion_scales.detach()],
        "word_change": [round(float((f - p)[mask].norm() / p[mask].norm()), 4) for f, p in zip(fused, plain)],
        "vector_change": float((1 - cosine).mean()),
    }


def word_coverage(lexicon: Lexicon, scorer: QuestionScorer) -> dict[str, float]:
    """Do questions and their documents' chunks share lexicon words at all?

    ``questions``/``chunks`` with a word: share of texts matching at least one word; ``shared``:
    share of questions with a matched word that also occurs in a chunk of a relevant document.
    """
    chunk_words: dict[str, set[int]] = {}
    for chunk in scorer.chunks:
        chunk_words.setdefault(chunk.group, set()).update(int(w) for w in lexicon.find(chunk.text)[:, 0])
    question_words = [set(int(w) for w in lexicon.find(q.text)[:, 0]) for q in scorer.queries]
    shared = [
        bool(words & set().union(*(chunk_words.get(g, set()) for g in q.gains)))
        for q, words in zip(scorer.queries, question_words)
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
    dev = dev_scores(cfg, model_dir, data)
    questions = scorer.score(name, model_dir, run_dir / "questions.json")
    result = {
        "arm": name,
        "seed": seed,
        "model": str(model_dir),
        "settings": asdict(arm),
        "train_minutes": round(train_minutes, 2),
        "dev": dev,
        **word_stream(model_dir, [c.text for c in scorer.chunks[:64]], cfg.max_length),
        "questions": {
            retriever: {"metrics": r["metrics"], MRR: [q[MRR] for q in r["queries"]]}
            for retriever, r in questions.items()
        },
    }
    write_json(result, result_file)
    return result


def embedding_speed(
    models: dict[str, Path], texts: list[str], device: str, cache: Path, reps: int = 3
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

    loaded = {name: PolicyBertEmbeddings(path, device=device) for name, path in models.items()}
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


def summarise(results: list[dict], arms: list[str], resamples: int = 1000) -> dict:
    """Per arm: mean ± sd over seeds of each score; per-query scores (dev queries, questions) averaged over seeds,
    bootstrapped vs ``base+ft``."""
    table: dict = {}
    per_question: dict[tuple[str, str], np.ndarray] = {}
    for name in arms:
        runs = [r for r in results if r["arm"] == name]
        row: dict = {"seeds": len(runs), "train_minutes": statistics.mean(r["train_minutes"] for r in runs)}
        row["dev " + MRR] = _mean_sd([r["dev"]["mrr@10"] for r in runs])
        per_question[name, "dev"] = np.mean([r["dev"][MRR] for r in runs], axis=0)
        for retriever in runs[0]["questions"]:
            kind = _row_key(retriever)
            row[f"{kind} {MRR}"] = _mean_sd([r["questions"][retriever]["metrics"][MRR] for r in runs])
            per_question[name, kind] = np.mean([r["questions"][retriever][MRR] for r in runs], axis=0)
        scales = [s for r in runs for s in r["fusion_scales"]]
        row["mean |s|"] = round(float(np.mean(np.abs(scales))), 4) if scales else None
        row["1 − cos, vector without words"] = (
            float(f"{np.mean([r['vector_change'] for r in runs]):.3g}") if runs[0]["word_change"] else None
        )
        table[name] = row
    for (name, kind), scores in per_question.items():
        if name != COMPETITOR and (COMPETITOR, kind) in per_question:
            competitor = per_question[COMPETITOR, kind]
            low, high = paired_bootstrap_interval(scores, competitor, resamples)
            table[name][f"Δ{kind} vs {COMPETITOR}"] = (
                round(float(np.mean(scores - competitor)), 4),
                round(low, 4),
                round(high, 4),
            )
    return table


def verdict(table: dict) -> str:
    """The word stream's verdict, by a rule fixed before the runs: chosen on dev, checked on the questions.

    The fused arm with the best mean dev MRR@10 (held-out documents) is the candidate default; it
    beats ``base+ft`` only if its paired 95 % interval on dev lies above 0. The questions are not
    used for the choice: their deltas are reported as the independent check.
    """
    fused = [name for name in table if ARMS[name].fusion and f"Δdev vs {COMPETITOR}" in table[name]]
    if not fused:
        return f"verdict: no fused arm was compared with {COMPETITOR}\n"
    best = max(fused, key=lambda name: table[name]["dev " + MRR][0])
    delta, low, high = table[best][f"Δdev vs {COMPETITOR}"]
    checks = ", ".join(
        f"{column.split()[0][1:]} {value[0]:+.4f} [{value[1]:+.4f}, {value[2]:+.4f}]"
        for column, value in table[best].items()
        if column.startswith("Δ") and not column.startswith("Δdev")
    )
    won = "beats" if low > 0 else "does not beat"
    return (
        f"verdict: best fused arm on dev is {best} (Δdev {delta:+.4f} [{low:+.4f}, {high:+.4f}]): it {won} "
        f"{COMPETITOR} on dev; on the questions, not used for the choice: {checks or 'not scored'}\n"
    )


def _bm25_key(column: str) -> str:
    """BM25's score beside a column: the dev pool's for ``dev …``, the questions' for ``dense …``/``chatchat …``."""
    return "dev" if column.startswith("dev") else "questions"


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return round(statistics.mean(values), 4), round(statistics.stdev(values), 4) if len(values) > 1 else 0.0


def markdown(table: dict, bm25: dict[str, float], speed: dict[str, float]) -> str:
    """The results table: one row per arm, then BM25 alone."""
    columns = [
        c for c in dict.fromkeys(c for row in table.values() for c in row) if c not in ("seeds", "train_minutes")
    ]
    lines = [
        "| arm | seeds | " + " | ".join(c.replace("|", "\\|") for c in columns) + " | speed vs start | train min |",
        "|---|---|" + "---|" * len(columns) + "---|---|",
    ]
    for name, row in table.items():
        cells = []
        for column in columns:
            value = row.get(column)
            if isinstance(value, tuple) and len(value) == 2:
                cells.append(f"{value[0]:.4f} ± {value[1]:.4f}")
            elif isinstance(value, tuple):
                cells.append(f"{value[0]:+.4f} [{value[1]:+.4f}, {value[2]:+.4f}]")
            else:
                cells.append("–" if value is None else f"{value}")
        lines.append(
            f"| {name} | {row['seeds']} | "
            + " | ".join(cells)
            + f" | {speed.get(name, '–')} | {row['train_minutes']:.1f} |"
        )
    lines.append(
        "| BM25 alone | – | "
        + " | ".join(f"{bm25[_bm25_key(c)]:.4f}" if c.endswith(MRR) else "–" for c in columns)
        + " | – | – |"
    )
    return "\n".join(lines) + "\n"


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


def plot(table: dict, bm25: dict[str, float], path: Path) -> None:
    """Bars of each arm's MRR@10 (mean, sd as error bars) per scoring, BM25 alone as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [c for c in next(iter(table.values())) if c.endswith(MRR)]
    figure, axes = plt.subplots(1, len(columns), figsize=(4.5 * len(columns), 4), squeeze=False)
    for axis, column in zip(axes[0], columns):
        names = list(table)
        means = [table[n][column][0] for n in names]
        sds = [table[n][column][1] for n in names]
        axis.bar(names, means, yerr=sds, capsize=3, color="#4878a8")
        axis.axhline(bm25[_bm25_key(column)], color="#c44", linestyle="--", label="BM25 alone")
        axis.legend(loc="upper left", fontsize=8)
        axis.set_title(column, fontsize=10)
        axis.tick_params(axis="x", rotation=45, labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(cfg: RetrievalAblationConfig, shape: init_scratch.ScratchShape) -> dict:
    """Every arm with every seed (a finished run is read back, not run again); writes ``OUT/results.json``,
    ``results.md`` and ``results.png``; returns what ``results.json`` holds."""
    import torch

    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    began = time.time()
    start = build_start(cfg, shape)
    data = Pairs.read(pairs_folder(cfg), cfg.train_group_size)
    scorer = QuestionScorer(cfg)
    results = []
    for seed in cfg.seeds:
        for name in cfg.arms:
            if not (ARMS[name].trains or seed == cfg.seeds[0]):  # an untrained arm is the same model for every seed
                continue
            if cfg.table_only and not run_result(cfg, name, seed).is_file():
                print(f"== arm {name}, seed {seed}: not run, left out of the table (--table-only) ==")
                continue
            print(f"== arm {name}, seed {seed} ==")
            results.append(run_arm(cfg, name, seed, start, data, scorer))
    if cfg.table_only and not results:
        raise InputError(f"--table-only: no finished run of --arms {' '.join(cfg.arms)} in {cfg.out / 'runs'}")
    cfg.arms = [name for name in cfg.arms if any(r["arm"] == name for r in results)]
    table = summarise(results, cfg.arms)
    first = {r["arm"]: r for r in reversed(results)}
    bm25 = {"dev": round(dev_bm25(data), 4), "questions": round(scorer.bm25.metrics[MRR], 4)}
    with_words = {name: Path(r["model"]) for name, r in first.items()}
    texts = [chunk.text for chunk in scorer.chunks[:SPEED_TEXTS]]
    speed = embedding_speed({"start": start, **with_words}, texts, cfg.device, cfg.out / "speed.json")
    coverage = {"--lexicon": word_coverage(Lexicon.load(cfg.lexicon), scorer)}
    if any(ARMS[name].kb_lexicon for name in cfg.arms):
        coverage["KB lexicon"] = word_coverage(Lexicon.load(kb_lexicon(cfg)), scorer)
    text = markdown(table, bm25, speed) + "\n" + verdict(table) + "\n" + coverage_table(coverage)
    text += (
        f"\nmean ± sd over seeds {cfg.seeds}; Δ: paired bootstrap (1000) over dev queries or questions "
        f"of the seed-averaged MRR@10 vs {COMPETITOR}, 95 % interval; "
        "speed: embedding time of the start ÷ the arm's, same run; "
        f"{(time.time() - began) / 60:.1f} min this invocation\n"
    )
    summary = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "start_shape": asdict(shape),
        "table": table,
        "bm25": bm25,
        "speed": speed,
        "coverage": coverage,
        "runs": results,
    }
    write_json(summary, cfg.out / "results.json")
    (cfg.out / "results.md").write_text(text, encoding="utf-8")
    plot(table, bm25, cfg.out / "results.png")
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

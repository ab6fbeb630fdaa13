"""Training pairs for the embedding model from an unlabelled corpus or a Chatchat knowledge base.

    python -m training.pairs --out runs/pairs                      # the shipped policy corpus
    python -m training.pairs --corpus my_policies/ --out runs/pairs --model models/policybert
    python -m training.pairs --chatchat-root ~/chatchat --kb WeiMingPolicies --out runs/pairs \\
        --llm --llm-model qwen2.5:7b

Passages are the chunks ``chatchat kb -r`` makes: with ``--corpus`` the corpus goes into a
temporary Chatchat root exactly as ``chatchat-policybert eval`` puts it there, and both read the
chunks back through Chatchat's own loader and splitter
(:mod:`chatchat_policybert.evaluation.knowledge_base`); with ``--chatchat-root`` the KB's own
content folder is split with that root's settings. Queries need no labels:

- ``ict`` — inverse cloze: a sentence of a chunk is the query, the chunk without it the positive;
- ``heading`` — a Markdown heading (a policy's title in the exported corpus) or a 第…章/节 line is
  the query, the text under it the positive;
- ``llm`` (``--llm``) — questions a citizen or an official would ask, written per chunk by an
  OpenAI-compatible chat endpoint (by default the deployment's own Ollama); answers are cached
  in ``OUT/llm_cache.jsonl`` as they arrive, so an interrupted run resumes where it stopped.

Hard negatives are drawn from a rank window (``--window 3-50``, as FlagEmbedding's ``hn_mine``)
of BM25 and, with ``--model``, of the dense model's ranking. BM25 tokenises as the deployment
does (``--analyzer``; default: the root's configured analyzer, else ``policy``): the chunks the
deployed BM25 half ranks high for a query are the ones the dense half must learn to rank below
the answer, so the pairs (and ``tune``'s cache of them) follow the analyzer. A
negative is never a false negative by construction: see :func:`.negatives.conflicts`. Whole documents
(identical copies together) are held out as the dev split; train lines never contain dev text.

``OUT`` gets ``train.jsonl`` and ``dev.jsonl`` in FlagEmbedding's format — one line
``{"query": str, "pos": [str], "neg": [str, …]}``, the format ``training.contrastive`` reads, so
labelled pairs of your own can sit beside them — ``pairs.json`` (counts and settings) and the
data licence notice.

The stages are modules of this package, as FlagEmbedding separates arguments, data and runner:
:mod:`.config` (the flags and their checks), :mod:`.queries` (ict and heading), :mod:`.llm` (the
chat endpoint's questions and their cache), :mod:`.negatives` (mining), :mod:`.split` (the dev
split); this module runs them.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from chatchat_policybert.chatchat.config import default_kb
from chatchat_policybert.data import CORPUS_CSV
from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.dataset import load_corpus
from chatchat_policybert.evaluation.knowledge_base import Chunk, load_chunks, prepare_root
from chatchat_policybert.evaluation.retrievers import Bm25, Dense, Retriever
from chatchat_policybert.files import write_json, write_jsonl
from chatchat_policybert.retrieval.analyzer import NEW_DEPLOYMENT, Analyzer, get_analyzer
from chatchat_policybert.retrieval.hybrid import configured_analyzer
from training._common import copy_license
from training.config import config_dict, parse_flags
from training.pairs.config import PairsConfig, check_config
from training.pairs.llm import LlmQuestions
from training.pairs.negatives import Miner, Pool
from training.pairs.queries import Pair, heading_pairs, inverse_cloze, representatives
from training.pairs.split import dev_groups


@contextmanager
def chunk_source(cfg: PairsConfig) -> Iterator[tuple[list[Chunk], Path]]:
    """The chunks to build pairs from, and the input the licence notice is looked up from."""
    if cfg.chatchat_root is not None:
        if cfg.corpus is not None or cfg.work_dir is not None:
            raise InputError("--chatchat-root reads a built KB: leave out --corpus and --work-dir")
        root = cfg.chatchat_root.resolve()
        kb = cfg.kb or default_kb(root)
        yield load_chunks(root, kb, None), root
        return
    if cfg.kb is not None:
        raise InputError("--kb only applies with --chatchat-root")
    source = cfg.corpus or CORPUS_CSV
    corpus = load_corpus(source)
    with tempfile.TemporaryDirectory(prefix="policybert-pairs-") as tmp:
        root = (cfg.work_dir or Path(tmp) / "root").resolve()
        yield load_chunks(root, prepare_root(root, corpus, None, build_index=False), corpus), source


def pairs_analyzer(cfg: PairsConfig) -> Analyzer:
    """The BM25 analyzer of the negatives: ``--analyzer``, else the root's configured one, else a new deployment's."""
    if cfg.analyzer is not None:
        return get_analyzer(cfg.analyzer)
    if cfg.chatchat_root is not None:
        return configured_analyzer(cfg.chatchat_root.resolve())
    return get_analyzer(NEW_DEPLOYMENT)


def pairs_from_chunks(cfg: PairsConfig, chunks: list[Chunk]) -> dict:
    """Writes train.jsonl and dev.jsonl for ``chunks`` into ``cfg.out``; returns the summary pairs.json holds."""
    started = time.perf_counter()
    kinds, window = check_config(cfg)
    dev = dev_groups(chunks, cfg.dev_ratio, cfg.seed)  # first: a corpus too small to split costs no LLM calls
    rng = random.Random(cfg.seed)
    indices = representatives(chunks)
    pairs: list[Pair] = []
    if "ict" in kinds:
        pairs += inverse_cloze(chunks, indices, cfg.ict_per_chunk, rng)
    if "heading" in kinds:
        pairs += heading_pairs(chunks, indices)
    if "llm" in kinds:
        llm = LlmQuestions(cfg.llm, cfg.llm_model, cfg.llm_questions, cfg.llm_timeout, cfg.out / "llm_cache.jsonl")
        pairs += llm.pairs(chunks, indices)
    unique: dict[str, Pair] = {}
    for pair in pairs:
        unique.setdefault(pair.query, pair)  # one positive per query: a second would be a false negative in-batch
    pairs = list(unique.values())

    pools = {"train": Pool([i for i, c in enumerate(chunks) if c.group not in dev]), "dev": Pool(range(len(chunks)))}
    analyzer = pairs_analyzer(cfg)
    retrievers: list[Retriever] = [Bm25(chunks, window[1], analyzer)]
    if cfg.model is not None:
        from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

        embeddings = PolicyBertEmbeddings(cfg.model, device=cfg.device, batch_size=cfg.batch_size)
        retrievers.append(Dense(f"dense:{cfg.model.name}", embeddings, chunks, window[1]))
    miner = Miner(chunks, retrievers, window, cfg.negatives, cfg.seed)
    lines: dict[str, list[dict]] = {"train": [], "dev": []}
    kinds_by_split: dict[str, Counter[str]] = {"train": Counter(), "dev": Counter()}
    for pair in tqdm(pairs, desc="mining negatives", unit="pair"):
        split = "dev" if chunks[pair.chunk].group in dev else "train"
        negatives = miner.negatives(pair, pools[split])
        lines[split].append({"query": pair.query, "pos": [pair.positive], "neg": negatives})
        kinds_by_split[split][pair.kind] += 1
    for split, rows in lines.items():
        write_jsonl(rows, cfg.out / f"{split}.jsonl")

    all_lines = lines["train"] + lines["dev"]
    counts = [len(line["neg"]) for line in all_lines]
    return {
        "chunks": len(chunks),
        "analyzer": analyzer.identity,
        "documents": len({c.group for c in chunks}),
        "dev_documents": len(dev),
        "pairs": {split: dict(sorted(c.items())) for split, c in kinds_by_split.items()},
        "negatives_per_pair": {
            "mean": round(sum(counts) / max(len(counts), 1), 2),
            "min": min(counts, default=0),
            "max": max(counts, default=0),
        },
        "negatives_drawn": {
            "from the rank window": miner.drawn["ranked"],
            "at random (window short)": miner.drawn["random"],
        },
        "miners": [r.name for r in retrievers],
        "seconds_pairs": round(time.perf_counter() - started, 1),
    }


def run(cfg: PairsConfig, command_line: list[str] | None = None) -> dict:
    """The stage: pairs from the configured chunks into ``cfg.out``, with ``pairs.json`` and the data licence;
    returns the summary ``pairs.json`` holds (``command_line``, where given, recorded in it)."""
    check_config(cfg)  # before the minutes of building a Chatchat root
    started = time.perf_counter()
    with chunk_source(cfg) as (chunks, source):
        summary = pairs_from_chunks(cfg, chunks)
    summary = {
        "command_line": command_line,
        "config": config_dict(cfg),
        **summary,
        "seconds_total": round(time.perf_counter() - started, 1),
    }
    write_json(summary, cfg.out / "pairs.json")
    copy_license(source, cfg.out)
    print(
        json.dumps(
            {k: summary[k] for k in ("chunks", "documents", "dev_documents", "pairs", "negatives_per_pair")},
            ensure_ascii=False,
        )
    )
    print(f"wrote {cfg.out / 'train.jsonl'}, {cfg.out / 'dev.jsonl'}, {cfg.out / 'pairs.json'}")
    return summary


def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(PairsConfig, argv, "python -m training.pairs", __doc__.split("\n\n")[0])
    run(cfg, sys.argv if argv is None else list(argv))

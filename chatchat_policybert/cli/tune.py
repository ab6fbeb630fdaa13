"""``chatchat-policybert tune --kb NAME --questions FILE``: the knowledge base's query tower trained on questions like
your users', judged on questions it never trained on, and installed only when the RAG path gets better.

    chatchat-policybert tune --kb WeiMingPolicies --questions my_questions.jsonl    # inside a root `setup` prepared
    chatchat-policybert tune --kb WeiMingPolicies --feedback                        # what your users marked
    chatchat-policybert tune --kb WeiMingPolicies --llm                             # the deployment's LLM writes them
    chatchat-policybert rollback --kb WeiMingPolicies                               # undo the last installed tune

Only the query tower is trained: a copy of the served model that embeds questions, learning to rank the chunk
vectors the store already holds (FAISS or pg: read, never re-embedded). The served model stays the document tower,
so nothing is re-embedded to install, and a document added later embeds exactly as before.

Steps (each leaves its result in the run folder ``--out``, default ``ROOT/policybert_tune/KB``, and is skipped when
found there, so a killed or failed run continues where it stopped; the training is the training package's
``training.query_side``, reached through the ``chatchat_policybert.training`` entry point):

1. ``questions`` — the ``--questions`` files, with ``--feedback`` the questions users marked (``feedback export``'s
   rules: under 6 characters, on a changed document, or repeating a later or a --questions one, dropped), and with
   ``--llm`` the LLM's questions per chunk (those copying 12 characters of their chunk dropped), each with its gold
   chunks among the stored vectors (a mark's: its document's, the recipe taking the chunk the served model ranks
   first; ``--feedback-positive marked``: the chunk the user marked; ``--feedback-propensity ETA``: each mark
   weighing one over the chance its document is found at the ranks it was shown, r^ETA where shown once at r, in
   the training and the gate's means), split into 3 folds by document (a text
   repeated or nearly repeated on several documents: all of them in one fold); with ``--silver`` also the questions
   nobody marked whose source the LLM named (silver labels, reported apart). Your questions judge where there are
   any, else the users', else the LLM's (``--llm``'s; silver labels never judge); the rest only train.
2. ``folds`` — per fold, a query tower trained from the served model on the other two folds' questions (150 steps
   of 32 questions, merged back halfway toward the served model; ``--query-args`` overrides the recipe), and each
   held-out question's vector by it.
3. ``train`` — the query tower trained on every question: what is installed if the gate passes.
4. ``gate`` — after: each question ranked by the plugin's ensemble with the tower of its held-out fold (never one
   that trained on its document) at the weights and threshold chosen on that fold's training questions; before:
   the same with the served query tower (after − before: the tuned tower's own effect, Δ 0 for a tower equal to
   its start). Installs when the paired 95 % bootstrap interval of MRR@10 of after against Chatchat's
   ``search_docs`` as deployed lies above 0 and the tower's own effect is not below 0 beyond noise; otherwise it
   says why, or about how many questions would decide it. Where users' marks judge (``--feedback`` without
   ``--questions``) the two roles swap: each mark was in the deployment's top k, which biases the comparison with
   ``search_docs`` as deployed, so the tower's own effect must lie above 0 and that comparison only not below 0.
   The hybrid weights and threshold installed are calibrated on the held-out vector lists.
5. ``install`` — the previous settings and vectors kept in ``OUT/previous`` (what ``rollback`` restores), the
   two-tower directory (the served weights plus ``query_tower.safetensors``) copied to
   ``ROOT/models/policybert-KB-query-KEY``, ``model_settings.yaml`` and ``kb_settings.yaml`` pointed at it with the
   calibrated hybrid (both settings files through a journal in the run folder: a killed install is finished by
   the same command), and every stored vector checked unchanged. Then restart Chatchat so that the API and WebUI
   load it: ``CHATCHAT_ROOT=ROOT chatchat start -a``.
6. ``report`` — ``OUT/report.md``: the gate's table, each fold's setting, the calibration, time and memory per step.

What it writes: the run folder (``tune.json``, ``query/`` with each fold's tower and vectors, ``query_gate.json``,
``report.md``, and after an install ``previous/``, ``installed.json``, ``query_towers/``); in the root, the installed
model directory and the two settings files. Nothing in the root changes before step 5.

What it costs: about 6 min on 2 CPU cores (AMD EPYC with AVX-512-BF16: 349 s) for the demo's 213 questions on
the e5 base, most of it the four trainings (three folds and the installed tower), which run under bf16 autocast on such
a CPU; peak RSS about 2.5 GB (docs/deployment.md, "Query-side tuning"); about 81 MB of disk per installed model (its
query tower; the served weights are linked where the file system allows). A GPU (``--device cuda``) is faster.

Before step 1 every input is checked (the KB name, ``--questions`` against the KB's documents, on at least 3 of
them (a fold each), each file once; with ``--feedback`` the marked questions read from the capture store;
``--query-args``, where ``--out``, ``--device`` and ``--seed`` are tune's own; ``--device``; ``--out``; ``--llm``
and ``--silver`` answering; the served query tower's record; on pg the right to read the collection), and the
knowledge base's tune lock is taken: a second ``tune`` or a ``rollback`` of the same knowledge base is refused while
one runs. An unfinished run folder begun from a model the root no longer serves starts over from the served one.

Exit status: 0 installed, 1 refused by the gate (the deployment unchanged), 2 a bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.settings import OLLAMA_URL
from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.errors import InputError

RETIRED = {"--inverse-cloze": 0, "--budget": None, "--pairs-args": None, "--contrastive-args": None}
"""Flags of 0.1.0's tune on pairs cut from the chunks, by the number of values each took (0: none, None: one)."""


class Retired(argparse.Action):
    """A flag removed in 0.2.0: refused as it is parsed, before any work, with one line saying why."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        raise InputError(
            f"tune {option_string}: removed in 0.2.0 (the inverse-cloze tune and its flags): training on sentences cut "
            "from the chunks lowered the e5 base on paraphrased questions at every scale tried (docs/training.md); "
            "tune learns from labelled questions (--questions FILE, or --llm), its training set by --query-args"
        )


def register(commands: Any) -> None:
    """Add ``tune`` and its flags to the subcommands of the main parser.

    Why the flags are declared here and the steps imported only when it runs: ``tune --help`` must
    answer at once, without torch, transformers or Chatchat (the steps need all three).
    """
    parser = commands.add_parser(
        "tune",
        help="train the knowledge base's query tower on your questions, gate it on questions it never saw, install "
        "it without re-embedding (training extras)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_root_argument(parser)
    parser.add_argument("--kb", help="knowledge base to tune on (default: DEFAULT_KNOWLEDGE_BASE)")
    parser.add_argument(
        "--questions",
        type=Path,
        action="append",
        metavar="FILE",
        help="your labelled questions, the evaluation's JSONL, as `chatchat-policybert eval` reads "
        '({"id", "question", "doc_title", "evidence"}; doc_title = a KB file name without suffix, or a --corpus '
        "title); repeatable; checked against the KB before any work. The query tower trains on them and is judged "
        "on them by cross-fitting (each question scored by a tower that never trained on its document)",
    )
    parser.add_argument(
        "--feedback",
        action="store_true",
        help="also train on the questions users asked in the RAG tab and marked (`setup --capture on`; the source "
        "they said answered, or an operator's `feedback label`), exported by `feedback export`'s rules; with "
        "--questions yours judge and the marks only train, without them the marks also judge (cross-fitted by "
        "document, the tower's own effect deciding: step 4)",
    )
    parser.add_argument(
        "--feedback-positive",
        choices=("best", "marked"),
        help="a marked question's positive: best (default), the chunk of the marked source's document the served "
        "model ranks first (what --questions trains on); marked, the chunk the user said answered (issue 49's "
        "replay: the gate installed best on every seed of user a's marks, marked on none; docs/deployment.md)",
    )
    parser.add_argument(
        "--feedback-propensity",
        type=float,
        metavar="ETA",
        help="assume users read the source shown at rank r with probability (1/r)^ETA, and weigh each mark by one over "
        "the chance its document is found at the ranks it was shown (r^ETA where shown once, at r) in the training "
        "and in the gate (propensity weighting, Joachims et al. 2017); default 0: every mark alike. Only with "
        "--feedback. Measure ETA with `setup --capture-swap` and `feedback propensity`; one larger than your "
        "users' inflates the gate's figure (issue 49's replay with 1, user b's own reading: b's marks installed on "
        "no seed of 3, too few to decide; user a's, who reads every source, on 3 of 3, the gate's figure 2.8 times "
        'its unweighted one; docs/deployment.md, "Position bias")',
    )
    parser.add_argument(
        "--llm",
        nargs="?",
        const=OLLAMA_URL,
        metavar="URL",
        help="also train on questions this OpenAI-compatible endpoint writes per chunk (with --questions yours judge, "
        f"without them the LLM's do; bare --llm: {OLLAMA_URL}, the deployment's Ollama)",
    )
    parser.add_argument(
        "--silver",
        nargs="?",
        const=OLLAMA_URL,
        metavar="URL",
        help="with --feedback: also train on silver labels, the source this OpenAI-compatible endpoint says answered "
        "each captured question nobody marked (reported apart; they never judge, so --questions or users' marks "
        f"must; bare --silver: {OLLAMA_URL}, the deployment's Ollama)",
    )
    parser.add_argument("--llm-model", help="chat model of --llm and --silver (default: the root's DEFAULT_LLM_MODEL)")
    parser.add_argument(
        "--corpus",
        type=Path,
        help="with --questions: the policy CSV or folder the KB was loaded from, whose titles doc_title names "
        "(e.g. the shipped questions with the shipped corpus)",
    )
    parser.add_argument(
        "--query-args",
        default="",
        help="flags for training.query_side overriding its recipe, e.g. '--max-steps 300 --merge-alpha 0.7'",
    )
    parser.add_argument(
        "--device", default="auto", help="training device: auto (a GPU where there is one), cpu, cuda, …"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the trainings' randomness (order, dropout); the folds do not change"
    )
    parser.add_argument(
        "--out", type=Path, help="run folder (default: ROOT/policybert_tune/KB); re-running continues it"
    )
    for flag, nargs in RETIRED.items():
        parser.add_argument(flag, action=Retired, nargs=nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs the tune the parsed flags describe (:func:`chatchat_policybert.deploy.tune.run_tune`)."""
    from chatchat_policybert.deploy.tune import run_tune

    return run_tune(args)

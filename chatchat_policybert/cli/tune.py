"""``chatchat-policybert tune --kb NAME``: from a knowledge base to a better deployed retriever, never a worse one.

    chatchat-policybert tune --kb WeiMingPolicies                       # inside a root `setup` prepared
    chatchat-policybert tune --kb WeiMingPolicies --budget 20           # training sized to about 20 min
    chatchat-policybert tune --kb WeiMingPolicies --llm --questions my_questions.jsonl
    chatchat-policybert rollback --kb WeiMingPolicies                   # undo the last installed tune

Steps (each leaves its result in the run folder ``--out``, default ``ROOT/policybert_tune/KB``, and
is skipped when found there, so a killed or failed run continues where it stopped). Steps 1 and 2
are the training package's (``training.tune``, found through the ``chatchat_policybert.training``
entry point: this package never imports ``training``), steps 3 to 6 this package's
(:mod:`chatchat_policybert.deploy`, run by :mod:`chatchat_policybert.deploy.tune`):

1. ``pairs`` — ``training.pairs`` on the knowledge base (with ``--llm``, the deployment's own LLM
   writes questions), cached per KB content: unchanged documents re-use the pairs.
2. ``train`` — ``training.contrastive`` from the model the root serves, with the recipe's defaults
   (:class:`training.contrastive.ContrastiveConfig`; from a mean-pooled pretrained start such as the
   e5 base, :data:`training.tune.PRETRAINED_MEAN_RECIPE`: lr 1e-5, at most 100 steps, 3 BM25 hard
   negatives a query, the piece-embedding matrix frozen; ``--contrastive-args`` overrides), resumed
   from its checkpoint; on CPU an estimate of the time is printed first. ``--budget MINUTES`` sizes
   the steps from one timed step and the two dev evaluations so that training takes about that long
   (the report says what was cut). A step whose activations would exceed 4 GiB runs its texts in
   chunks (``--embed-chunk``, the same loss and gradient): the recipe's batch at 512 tokens needs
   some 300 GB for bge-base.
3. ``candidate`` (:mod:`chatchat_policybert.deploy.candidate`) — a Chatchat root of its own (the
   root's model and KB settings, the candidate model, the KB's documents, ``chatchat kb -r``), then
   the ensemble's weights and threshold calibrated there as the deployment's were: on the questions
   its calibration recorded (``setup --calibrate FILE``; the demo's: the shipped 49), else on the dev
   pairs (:mod:`chatchat_policybert.deploy.calibration`). On pg its tables are in a schema of their own in
   the deployment's database (:class:`chatchat_policybert.stores.pg_schema.OwnSchema`), dropped once
   the gate's decision is carried out.
4. ``gate`` (:mod:`chatchat_policybert.deploy.gate`) — Chatchat's own ``search_docs`` in the root as
   it is (before) and in the candidate root (after), on the held-out-document dev pairs and on the
   paraphrase-like questions it has — ``--questions``, else the shipped questions where the KB is the
   shipped corpus, and the LLM's questions on held-out documents with ``--llm`` — with BM25 alone as
   a third row, and the paired bootstrap of ``eval --require-better``. The rule
   (:func:`chatchat_policybert.evaluation.gate_rule.tune_gate_failures`): where questions exist they
   judge (MRR@10 above the deployed one on each) and the dev pairs only check (not below), since
   inverse-cloze pairs call better a model that paraphrased questions find worse; without questions
   the dev pairs' MRR@10 must rise. The rows, the interval and what the candidate changes (e.g. "the
   calibration chose BM25 alone") are printed. The decision is cached with its inputs (candidate,
   question files' contents, the deployment's settings and model): a change of any of them decides
   again.
5. ``install`` (:mod:`chatchat_policybert.deploy.install`) — the previous model, settings and
   vectors are kept (``OUT/previous``, what ``chatchat-policybert rollback`` restores), the candidate
   model is copied into ``ROOT/models/``, the settings point at it with the calibrated weights, and
   the KB is rebuilt with the transactional ``chatchat kb -r``; a failed rebuild puts the settings
   back. Nothing outside the run folder (and, on pg, the candidate's schema) changes before this step.
6. ``report`` (:mod:`chatchat_policybert.deploy.report`) — ``OUT/report.md`` (tables, commands, time
   per step) and ``OUT/report.png``.

Before step 1 every input is checked (the KB name, ``--questions`` against the KB's documents,
the flags), and the knowledge base's tune lock is taken: a second ``tune`` or a ``rollback`` of
the same knowledge base is refused while one runs. After ``rollback`` the same command installs
the rolled-back candidate again, and says so.

Exit status: 0 installed, 1 refused by the gate (the deployment unchanged), 2 a bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.settings import OLLAMA_URL
from chatchat_policybert.cli.common import add_root_argument


def register(commands: Any) -> None:
    """Add ``tune`` and its flags to the subcommands of the main parser.

    Why the flags are declared here and the steps imported only when it runs: ``tune --help`` must
    answer at once, without torch, transformers or Chatchat (the steps need all three).
    """
    parser = commands.add_parser(
        "tune",
        help="from a knowledge base to a better deployed retriever: pairs, contrastive training, the gate on the RAG "
        "path, calibration, install (training extras)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_root_argument(parser)
    parser.add_argument("--kb", help="knowledge base to tune on (default: DEFAULT_KNOWLEDGE_BASE)")
    parser.add_argument(
        "--llm",
        nargs="?",
        const=OLLAMA_URL,
        metavar="URL",
        help="also train on questions this OpenAI-compatible endpoint writes per chunk "
        f"(bare --llm: {OLLAMA_URL}, the deployment's Ollama)",
    )
    parser.add_argument("--llm-model", help="chat model of --llm (default: the root's DEFAULT_LLM_MODEL)")
    parser.add_argument(
        "--questions",
        type=Path,
        action="append",
        metavar="FILE",
        help="your labelled questions, the evaluation's JSONL, as `chatchat-policybert eval` reads "
        '({"id", "question", "doc_title", "evidence"}; doc_title = a KB file name without suffix, or a --corpus '
        "title); repeatable; checked against the KB before any work. The query tower trains on them and is judged "
        "on them by cross-fitting (each question scored by a tower that never trained on its document). With "
        "--inverse-cloze: one file, which only judges",
    )
    parser.add_argument(
        "--inverse-cloze",
        action="store_true",
        help="the earlier recipe: both towers trained on sentences cut from the chunks (training.pairs), a candidate "
        "`kb -r`, the gate on dev pairs and --questions (it lowered the e5 base on paraphrased questions: "
        "docs/training.md)",
    )
    parser.add_argument(
        "--query-args",
        default="",
        help="flags for training.query_side overriding its recipe, e.g. '--max-steps 300 --merge-alpha 0.7'",
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        help="with --questions: the policy CSV or folder the KB was loaded from, whose titles doc_title names "
        "(e.g. the shipped questions with the shipped corpus)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        metavar="MINUTES",
        help="size the training to about MINUTES on this machine (steps from one timed step, at most the "
        "recipe's; the report says what was cut); pairs, candidate, gate and install take minutes more",
    )
    parser.add_argument(
        "--device", default="auto", help="training device: auto (a GPU where there is one), cpu, cuda, …"
    )
    parser.add_argument(
        "--out", type=Path, help="run folder (default: ROOT/policybert_tune/KB); re-running continues it"
    )
    parser.add_argument(
        "--pairs-args",
        default="",
        help="flags for training.pairs, e.g. '--dev-ratio 0.2 --ict-per-chunk 2' (default: its defaults)",
    )
    parser.add_argument(
        "--contrastive-args",
        default="",
        help="flags for training.contrastive overriding the recipe's defaults, e.g. '--max-steps 100' "
        "(fewer steps, a shorter run) or '--lr 2e-5'",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs the tune the parsed flags describe (:func:`chatchat_policybert.deploy.tune.run_tune`)."""
    from chatchat_policybert.deploy.tune import run_tune

    return run_tune(args)

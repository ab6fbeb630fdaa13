"""``chatchat-policybert setup``: its flags, and what it prints. The work is
:func:`chatchat_policybert.configure.setup.plan_setup` (every input checked, the shipped settings merged in memory into
a root that ``chatchat init`` prepared), ``--calibrate``'s checks of its questions
(:func:`chatchat_policybert.deploy.calibration.check_calibration_inputs`), and only then the writes: the settings, the
calibration (:func:`chatchat_policybert.deploy.calibration.calibrate_setup`; all three settings files go back byte for
byte where it refuses), then the doctor's checks (:func:`chatchat_policybert.configure.doctor.diagnose`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import SETTINGS_FILES, SETUP_RECORD, restored_on_failure
from chatchat_policybert.chatchat.root import BASIC_SETTINGS, CAPTURE_SETTINGS
from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.cli.doctor import report
from chatchat_policybert.configure.doctor import diagnose
from chatchat_policybert.configure.setup import SetupOptions, plan_setup
from chatchat_policybert.errors import InputError
from chatchat_policybert.model.dtypes import DTYPE_CHOICES
from chatchat_policybert.retrieval.analyzer import ANALYZERS, NEW_DEPLOYMENT
from chatchat_policybert.stores import STORES


def register(commands: Any) -> None:
    """Add ``setup`` and its flags to the subcommands of the main parser."""
    setup = commands.add_parser(
        "setup", help="merge the PolicyBERT settings into a Chatchat root and check it", description=run_setup.__doc__
    )
    add_root_argument(setup)
    setup.add_argument("--model", type=Path, help="PolicyBERT (or BERT/bge) model directory to use")
    setup.add_argument("--device", help="torch device for the model, e.g. cpu or cuda:0")
    setup.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="compute dtype (float32: the same vectors everywhere; auto: bfloat16 where the CPU/GPU has it)",
    )
    setup.add_argument("--ollama-url", help="Ollama OpenAI-compatible base URL (default http://127.0.0.1:11434/v1)")
    setup.add_argument(
        "--vs",
        choices=tuple(STORES),
        help="vector store to use, with the SCORE_THRESHOLD keeping cosine >= 0.5 in it (default: the "
        "shipped faiss). faiss: one index file per knowledge base, dense + BM25 retrieval; "
        "pg: PostgreSQL + pgvector (needs --pg-uri and the [pg] extra); both get the BM25 + vector ensemble",
    )
    setup.add_argument(
        "--pg-uri",
        help="with --vs pg: Chatchat's kbs_config.pg.connection_uri, "
        "postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE",
    )
    setup.add_argument(
        "--settings-dir",
        type=Path,
        default=None,
        help="folder with the model_settings.yaml/kb_settings.yaml to merge (default: the shipped ones)",
    )
    setup.add_argument(
        "--keep-other-platforms",
        action="store_true",
        help="keep existing MODEL_PLATFORMS entries whose names the shipped file does not use",
    )
    setup.add_argument(
        "--analyzer",
        choices=ANALYZERS,
        help="how BM25 tokenises (the hybrid block's analyzer): policy (stopwords and punctuation out, Chinese "
        "character bigrams in) or chatchat (Chatchat's own jieba tokens); default: what the merged "
        f"model_settings.yaml says (the shipped one: {NEW_DEPLOYMENT}). A change takes effect with `chatchat kb -r`",
    )
    setup.add_argument(
        "--bind",
        default="127.0.0.1",
        metavar="HOST",
        help="address Chatchat's API and WebUI listen on (default 127.0.0.1: this machine only; `chatchat init` "
        "writes 0.0.0.0, which exposes the unauthenticated API to the network)",
    )
    setup.add_argument(
        "--capture",
        choices=("on", "off"),
        help="record the questions users ask the API about a local knowledge base (redacted, with the hits shown) "
        "so that they can say which source answered, for `chatchat-policybert feedback`; off by default, takes "
        "effect at the next question (no restart); default: as the root has it",
    )
    setup.add_argument(
        "--capture-retention",
        type=int,
        metavar="DAYS",
        help="days a captured question and its feedback are kept before they are deleted (default 180)",
    )
    setup.add_argument(
        "--capture-swap",
        type=float,
        metavar="SHARE",
        help="share of captured RAG questions (0 to 1; default 0) shown with their first source in the place of "
        "another shown one, recorded, so that `feedback propensity` can measure how much less users read lower "
        "sources (Joachims et al. 2017's swap intervention; the LLM reads the same sources; the WebUI's RAG tab tells "
        "its users)",
    )
    setup.add_argument("--no-check", action="store_true", help="skip the doctor's checks after merging")
    setup.add_argument(
        "--calibrate",
        type=Path,
        metavar="FILE",
        help="after `chatchat kb -r` with this model: choose the FAISS ensemble's BM25/dense weights and "
        "SCORE_THRESHOLD on these held-out questions (training.pairs' dev.jsonl, or the evaluation's "
        "JSONL questions) so the RAG path is at least as good there as BM25 or dense alone; records "
        "them and their metrics in the settings (without it, setup keeps Chatchat's 0.5/0.5)",
    )
    setup.add_argument(
        "--kb", help="with --calibrate: the knowledge base to calibrate on (default: DEFAULT_KNOWLEDGE_BASE)"
    )
    setup.add_argument(
        "--corpus",
        type=Path,
        metavar="CSV",
        help="with --calibrate: the policy CSV whose titles the labelled questions name (e.g. the shipped corpus for "
        "the shipped questions; default: they name the knowledge base's files)",
    )
    setup.set_defaults(func=run_setup)


def run_setup(args: argparse.Namespace) -> int:
    """Merge the shipped settings into a root prepared by `chatchat init`, then check it."""
    for flag, value in (("--kb", args.kb), ("--corpus", args.corpus)):
        if value is not None and args.calibrate is None:
            raise InputError(f"{flag} only applies with --calibrate")
    if args.calibrate is not None:
        from chatchat_policybert.deploy.questions import is_pairs_file
        from chatchat_policybert.stores.rebuild import built_kb

        is_pairs_file(args.calibrate)  # found, UTF-8 and JSON before the root changes (a GBK file: one line)
        if args.kb is not None:
            built_kb(args.root, args.kb)  # before the model loads
    options = SetupOptions(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        ollama_url=args.ollama_url,
        store=args.vs,
        pg_uri=args.pg_uri,
        settings_dir=args.settings_dir,
        keep_other_platforms=args.keep_other_platforms,
        analyzer=args.analyzer,
        bind=args.bind,
        capture=None if args.capture is None else args.capture == "on",
        capture_retention=args.capture_retention,
        capture_swap=args.capture_swap,
    )
    plan = plan_setup(args.root, options)  # every input of setup checked, the model loaded; nothing written yet
    if args.calibrate is None:
        print(plan.write().text(), flush=True)
    else:
        from chatchat_policybert.deploy.calibration import calibrate_setup, check_calibration_inputs

        kb = built_kb(args.root, args.kb or plan.kb)
        check_calibration_inputs(args.root, kb, args.calibrate, args.corpus)
        # All or nothing: the calibration runs on the root as setup writes it; if it refuses, the files go back.
        with restored_on_failure(args.root, (*SETTINGS_FILES, BASIC_SETTINGS, SETUP_RECORD, CAPTURE_SETTINGS)):
            print(plan.write().text(), flush=True)
            print(calibrate_setup(args.root, kb, args.calibrate, args.corpus))
    if args.no_check:
        return 0
    return report(diagnose(args.root, load_model=True))

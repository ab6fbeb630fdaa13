"""``chatchat-policybert feedback list|export|label|propensity|purge``: the operator's side of the questions the
API captured (``setup --capture on``) and the sources users said answered them.

The store is :mod:`chatchat_policybert.feedback.store` (the root's own SQLite file, readable by the deployment's user
only: run these commands as that user), or, where the knowledge base is on PostgreSQL,
:mod:`chatchat_policybert.feedback.pg_store` (the plugin's schema of that database); the export's rules are
:mod:`chatchat_policybert.feedback.export`. Every call first deletes what is older than the retention setting
(``setup --capture-retention``, 180 days by default).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatchat_policybert.chatchat.config import default_kb
from chatchat_policybert.chatchat.root import content_dir
from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.errors import InputError, PlainArgumentParser
from chatchat_policybert.feedback.export import DROP_RULES, document_text, export_questions
from chatchat_policybert.feedback.propensity import TooFewSwaps, estimate_propensity, observations
from chatchat_policybert.feedback.settings import read_capture
from chatchat_policybert.feedback.store import (
    FeedbackStore,
    UnknownCapture,
    apply_retention,
    open_store,
    store_location,
)
from chatchat_policybert.files import write_jsonl

if TYPE_CHECKING:
    from chatchat_policybert.feedback.pg_store import PgFeedbackStore


def register(commands: Any) -> None:
    """Add ``feedback`` and its five subcommands to the subcommands of the main parser."""
    feedback = commands.add_parser(
        "feedback",
        help="list, export, label or purge the questions users asked and the sources they marked, or measure from "
        "them how much less users read lower sources (propensity)",
        description=__doc__,
    )
    actions = feedback.add_subparsers(dest="action", required=True, parser_class=PlainArgumentParser)

    listing = actions.add_parser("list", help="the captured questions of a knowledge base, oldest first")
    _common(listing, "the knowledge base (default: DEFAULT_KNOWLEDGE_BASE)")
    listing.add_argument(
        "--json", action="store_true", help="one JSON array: each capture with its hits, feedback and label"
    )
    listing.set_defaults(func=run_list)

    export = actions.add_parser(
        "export", help="write the marked questions as the JSONL `tune --questions` reads, and what was dropped"
    )
    _common(export, "the knowledge base (default: DEFAULT_KNOWLEDGE_BASE)")
    export.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSONL file to write")
    export.add_argument("--force", action="store_true", help="replace FILE where it exists")
    export.set_defaults(func=run_export)

    label = actions.add_parser(
        "label", help="name the document that answers a captured question (e.g. one users marked 'none')"
    )
    _common(label, "the knowledge base of the capture (default: DEFAULT_KNOWLEDGE_BASE)")
    label.add_argument(
        "capture_id",
        metavar="CAPTURE_ID",
        help="the capture's id (`feedback list`; an id an older store gave that starts with `-`: put `--` before it)",
    )
    label.add_argument("--doc", required=True, help="the knowledge base's file that answers, e.g. 政策.md")
    label.add_argument(
        "--evidence", required=True, help="a passage of that file that answers, copied verbatim (tune's evidence)"
    )
    label.set_defaults(func=run_label)

    propensity = actions.add_parser(
        "propensity",
        help="measure how much less users read the sources shown lower (ETA for `tune --feedback-propensity`), "
        "from the questions `setup --capture-swap` showed with their first source moved",
        description=run_propensity.__doc__,
    )
    _common(propensity, "the knowledge base (default: DEFAULT_KNOWLEDGE_BASE)")
    propensity.add_argument("--json", action="store_true", help="one JSON object: ETA, its interval and the counts")
    propensity.set_defaults(func=run_propensity)

    purge = actions.add_parser(
        "purge",
        help="delete captured questions and their feedback, leaving their text in none of the store's files and none "
        "of tune's run folders",
        description=run_purge.__doc__,
    )
    _common(purge, "only this knowledge base's captures (default: every knowledge base's)")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=_days, metavar="DAYS", help="those captured more than DAYS days ago")
    which.add_argument("--all", action="store_true", help="all of them")
    purge.set_defaults(func=run_purge)


def _common(parser: argparse.ArgumentParser, kb_help: str) -> None:
    add_root_argument(parser)
    parser.add_argument("--kb", help=kb_help)


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days >= 0 or days == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of days, 0 or more")
    return days


def _kb(args: argparse.Namespace) -> str:
    return args.kb or default_kb(args.root)


def _retention(root: Path) -> None:
    """The retention purge every command runs first; says what it deleted."""
    days = read_capture(root).retention_days
    purged = apply_retention(root, days)
    if purged.captures:
        print(
            f"deleted {purged.captures} captured question(s) older than the retention setting ({days} days); "
            f"{purged.run_files}"
        )


def _open(root: Path) -> FeedbackStore | PgFeedbackStore | None:
    _retention(root)
    return open_store(root, create=False)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_list(args: argparse.Namespace) -> int:
    """Print the knowledge base's captured questions, oldest first (``--json``: one array, for scripts)."""
    kb = _kb(args)
    store = _open(args.root)
    captures = [] if store is None else store.captures(kb)
    if store is not None:
        store.close()
    if args.json:
        for capture in captures:
            capture["time"] = _iso(capture["time"])
            for mark in (*capture["feedback"], *([capture["label"]] if capture["label"] else [])):
                mark["time"] = _iso(mark["time"])
        print(json.dumps(captures, ensure_ascii=False, indent=1))
        return 0
    if not captures:
        print(f"no question captured for '{kb}' ({store_location(args.root)})")
        return 0
    for capture in captures:
        marks = [f"[{f['rank']}]" if f["verdict"] == "answered" else "none" for f in capture["feedback"]]
        if capture["label"]:
            marks.append(f"label {capture['label']['source']}")
        shown = ", ".join(marks) or "-"
        print(
            f"{_iso(capture['time'])}  {capture['id']}  {len(capture['hits'])} hits  {shown:<12}  {capture['question']}"
        )
    return 0


def run_export(args: argparse.Namespace) -> int:
    """Write the knowledge base's marked questions as ``tune --questions`` JSONL, and say how many each rule
    dropped."""
    kb, out = _kb(args), Path(args.out)
    if out.exists() and not args.force:
        raise InputError(f"--out {out}: exists; pass --force to replace it")
    if out.is_dir():
        raise InputError(f"--out {out}: a folder; expected a file to write")
    store = _open(args.root)
    if store is None:
        raise InputError(f"{store_location(args.root)}: no store; nothing was captured (`setup --capture on`)")
    with store:
        captures = store.captures(kb)
    result = export_questions(args.root, kb, captures)
    dropped = "; ".join(f"{result.dropped[rule]} {text}" for rule, text in DROP_RULES.items())
    print(f"dropped: {dropped}")
    print(f"not exported: {result.unmarked} question(s) with no source marked 'answered' and no label")
    if not result.rows:
        raise InputError(f"no question of '{kb}' to export ({len(captures)} captured); {out} not written")
    write_jsonl(result.rows, out)
    print(f"wrote {len(result.rows)} question(s) to {out}: `chatchat-policybert tune --kb {kb} --questions {out}`")
    return 0


def run_propensity(args: argparse.Namespace) -> int:
    """Estimate ETA, how much less users read the sources shown lower (the source at rank r read with probability
    (1/r)^ETA), from the questions `setup --capture-swap SHARE` showed with their first source in another
    document's place: how often users marked that document where it was moved, against where it stayed first.
    Prints ETA with its 95 % bootstrap interval and the counts it rests on; one error line while there is no
    swapped question or no mark yet. Pass ETA to `tune --feedback --feedback-propensity ETA` yourself: tune never
    applies it on its own."""
    kb = _kb(args)
    store = _open(args.root)
    if store is None:
        raise InputError(f"{store_location(args.root)}: no store; nothing was captured (`setup --capture on`)")
    with store:
        captures = store.captures(kb)
    try:
        estimate = estimate_propensity(observations(captures))
    except TooFewSwaps as exc:
        raise InputError(f"'{kb}': {exc}") from None
    if args.json:
        print(json.dumps({"kb": kb, **estimate.as_json()}, ensure_ascii=False, indent=1))
        return 0
    questions, marked = estimate.unswapped
    print(f"'{kb}': the document ranked first, shown first: marked in {marked} of {questions} question(s)")
    for place, (n, m) in sorted(estimate.by_place.items()):
        print(f"  shown at {place} (swapped): marked in {m} of {n}")
    print(
        f"ETA {estimate.eta:.2f} [{estimate.low:.2f}, {estimate.high:.2f}] (95 %): users read the source at rank r "
        f"about (1/r)^{estimate.eta:.2f} as often as the first; `tune --feedback --feedback-propensity ETA` weighs "
        "marks by it (an interval that holds 0 says nothing against leaving it at 0)"
    )
    return 0


def run_label(args: argparse.Namespace) -> int:
    """Record the document (and a passage of it) that answers a captured question."""
    kb = _kb(args)
    text = document_text(args.root, kb, args.doc)
    if text is None:
        raise InputError(
            f"--doc {args.doc}: not a .md/.txt file of {content_dir(args.root, kb)} in UTF-8 (what tune reads)"
        )
    evidence = args.evidence.strip()
    if not evidence or evidence not in text:
        raise InputError(f"--evidence: not a verbatim passage of {args.doc}: {args.evidence[:60]!r}")
    store = _open(args.root)
    if store is None:
        raise InputError(f"capture {args.capture_id}: no such captured question (no store yet)")
    with store:
        try:
            store.label(args.capture_id, kb, args.doc, evidence)
        except UnknownCapture:
            raise InputError(f"capture {args.capture_id}: no such captured question of '{kb}'") from None
    print(f"labelled {args.capture_id}: {args.doc}")
    return 0


def run_purge(args: argparse.Namespace) -> int:
    """Delete captured questions with their hits, feedback and labels, and leave their text in none of the store's
    files (SQLite's file, -wal and -shm rewritten; on PostgreSQL its tables vacuumed) and none of tune's run folders
    (ROOT/policybert_tune/KB, and every --out a `tune --feedback` wrote): the gate's record and the tower records lose
    those questions' held-out entries (a later tune has no held-out score for them); any other file that holds one
    (a step's cache, a log, the report) is deleted, and the next tune recomputes what it needs. Run it when no tune
    runs."""
    store = _open(args.root)
    if store is None:
        print(f"nothing to purge: no store at {store_location(args.root)}")
        return 0
    started = time.monotonic()
    with store:
        purged = store.purge(older_than_days=None if args.all else args.older_than, kb=args.kb)
    which = f"of '{args.kb}'" if args.kb else "of every knowledge base"
    age = "" if args.all else f" older than {args.older_than:g} days"
    print(
        f"deleted {purged.captures} captured question(s) {which}{age}; {store_location(args.root)} rewritten without "
        f"their text; tune's run folders: {purged.run_files} ({time.monotonic() - started:.1f} s)"
    )
    return 0

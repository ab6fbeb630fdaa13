"""``chatchat-policybert setup``: merge the shipped settings into a root that ``chatchat init`` prepared.

It points the PolicyBERT platform at ``--model``, creates the default knowledge base folder, then
runs the doctor's checks (:mod:`chatchat_policybert.cli.doctor`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.root import SERVERS, content_dir, default_kb
from chatchat_policybert.chatchat.settings import PLATFORM_KEY, find_local_model, round_trip_yaml
from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.cli.doctor import PG_HYBRID_NOTE, diagnose, report
from chatchat_policybert.errors import InputError
from chatchat_policybert.model.dtypes import DTYPE_CHOICES
from chatchat_policybert.retrieval.analyzer import ANALYZERS, NEW_DEPLOYMENT
from chatchat_policybert.retrieval.hybrid import HYBRID_KEY, HybridConfig, configured_analyzer, parse_hybrid
from chatchat_policybert.stores import STORES
from chatchat_policybert.stores.base import TARGET_COSINE
from chatchat_policybert.stores.faiss_store import faiss_indexes

SETTINGS_FILES = ("model_settings.yaml", "kb_settings.yaml")
BASIC_SETTINGS = "basic_settings.yaml"


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
    setup.set_defaults(func=run_setup)


def shipped_settings_dir() -> Path:
    """Where the shipped YAML files are: packaged copies in a wheel, the repository root otherwise."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "chatchat_settings"
    if (packaged / SETTINGS_FILES[0]).is_file():
        return packaged
    return package.parent


def merge_settings(target: Any, shipped: Any, keep_other_platforms: bool) -> None:
    """Write `shipped` keys into `target` (ruamel maps, comments kept).

    Mappings merge key by key; `MODEL_PLATFORMS` is replaced by the shipped list, plus, with
    `keep_other_platforms`, the existing platforms whose names it does not use.
    """
    for key, value in shipped.items():
        if key == "MODEL_PLATFORMS" and keep_other_platforms:
            names = {p.get("platform_name") for p in value}
            kept = [p for p in target.get(key) or [] if p.get("platform_name") not in names]
            value.extend(kept)
            target[key] = value
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_settings(target[key], value, keep_other_platforms)
        else:
            target[key] = value


def run_setup(args: argparse.Namespace) -> int:
    """Merge the shipped settings into a root prepared by `chatchat init`, then check it."""
    root: Path = args.root
    missing = [name for name in SETTINGS_FILES if not (root / name).is_file()]
    if missing:
        raise InputError(f"{root} has no {', '.join(missing)}: run `CHATCHAT_ROOT={root} chatchat init` first")
    if args.kb is not None and args.calibrate is None:
        raise InputError("--kb only applies with --calibrate")
    if args.calibrate is not None:
        from chatchat_policybert.deploy.calibration import is_pairs_file

        is_pairs_file(args.calibrate)  # found, UTF-8 and JSON before the root changes (a GBK file: one line)
    if args.pg_uri is not None and args.vs != "pg":
        raise InputError("--pg-uri is only used with --vs pg")
    if args.vs == "pg":
        from chatchat_policybert.stores.pg_store import validate_uri

        if args.pg_uri is None:
            raise InputError("--vs pg needs --pg-uri postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE")
        validate_uri(args.pg_uri)
    yaml = round_trip_yaml()
    basic = _bound(root, args.bind, yaml)  # checked before any file is written
    source = args.settings_dir or shipped_settings_dir()
    for name in SETTINGS_FILES:
        shipped = yaml.load((source / name).read_text(encoding="utf-8"))
        if name == "model_settings.yaml":
            platform = find_local_model(shipped).entry
            block = platform[PLATFORM_KEY]
            if args.analyzer is not None:
                hybrid = parse_hybrid(platform) or HybridConfig()
                platform[HYBRID_KEY] = hybrid.model_copy(update={"analyzer": args.analyzer}).block()
            if args.model is not None:
                block["model_path"] = str(args.model.resolve())
            for key in ("device", "dtype"):
                if getattr(args, key):
                    block[key] = getattr(args, key)
            if args.ollama_url:
                for platform in shipped["MODEL_PLATFORMS"]:
                    if platform.get("platform_type") == "ollama":
                        platform["api_base_url"] = args.ollama_url
        elif args.vs is not None:
            _choose_store(shipped, args.vs, args.pg_uri)
        path = root / name
        current = yaml.load(path.read_text(encoding="utf-8")) or {}
        merge_settings(current, shipped, args.keep_other_platforms)
        with path.open("w", encoding="utf-8") as handle:
            yaml.dump(current, handle)
        print(f"OK    merged {source / name} into {path}")
    with (root / BASIC_SETTINGS).open("w", encoding="utf-8") as handle:
        yaml.dump(basic, handle)
    print(f"OK    Chatchat's API and WebUI listen on {args.bind} ({root / BASIC_SETTINGS})")
    _link_nltk_data(root)
    kb_dir = content_dir(root, default_kb(root))
    kb_dir.mkdir(parents=True, exist_ok=True)
    print(f"OK    knowledge base folder {kb_dir} (put documents here, then `chatchat kb -r -n {kb_dir.parent.name}`)")
    _say_analyzer(root, kb_dir.parent.name)
    if args.calibrate is not None:
        calibrate_setup(root, args.kb or default_kb(root), args.calibrate)
    if args.no_check:
        return 0
    return report(diagnose(root, load_model=True))


def _say_analyzer(root: Path, kb: str) -> None:
    """Which analyzer BM25 now uses, and that `kb -r` is due where the KB's saved BM25 index was built by another."""
    from chatchat_policybert.retrieval.bm25_index import BM25_FILE, SavedIndexUnusable, saved_summary

    analyzer = configured_analyzer(root)
    print(f"OK    BM25 analyzer {analyzer.name} ({analyzer.identity})")
    for index in faiss_indexes(root, kb):
        try:
            built_by = saved_summary(index.parent / BM25_FILE)[0]
        except (FileNotFoundError, SavedIndexUnusable):
            built_by = None
        if built_by != analyzer.identity:
            print(
                f"NOTE  the BM25 index of {kb} ({index.parent.name}) was built by {built_by or 'no saved index'}: "
                f"run `chatchat kb -r -n {kb}` so that BM25 uses {analyzer.name} without tokenising at every start"
            )


def calibrate_setup(root: Path, kb: str, questions: Path) -> None:
    """``setup --calibrate``: choose the ensemble's weights and threshold on ``questions`` and record them."""
    from chatchat_policybert.deploy.calibration import calibrate_root, ensemble_label, write_calibration

    calibration = calibrate_root(root, kb, questions, root / "logs")
    print(calibration.table())
    write_calibration(root, calibration)
    chosen = calibration.chosen
    print(
        f"OK    calibrated the {ensemble_label(calibration.store)} "
        f"on {calibration.questions} questions of {questions}: "
        f"{chosen.label} (written to model_settings.yaml and kb_settings.yaml)"
    )


def _choose_store(kb_settings: Any, store: str, uri: str | None) -> None:
    """Point the kb_settings to merge at ``store``, with the threshold keeping cosine >= TARGET_COSINE there.

    The threshold is rounded up at the 4th decimal, so the cut stays at (not below) the target.
    """
    kb_settings["DEFAULT_VS_TYPE"] = store
    kb_settings["SCORE_THRESHOLD"] = math.ceil(STORES[store].score_threshold_for(TARGET_COSINE) * 1e4) / 1e4
    if uri is not None:
        kb_settings["kbs_config"] = {store: {"connection_uri": uri}}
    if store == "pg":
        print(f"NOTE  {PG_HYBRID_NOTE}")


def _bound(root: Path, host: str, yaml: Any) -> Any:
    """basic_settings.yaml with ``host`` for Chatchat's API and WebUI (comments and other keys kept), to write."""
    path = root / BASIC_SETTINGS
    if not path.is_file():
        raise InputError(f"{root} has no {BASIC_SETTINGS}: run `CHATCHAT_ROOT={root} chatchat init` first")
    basic = yaml.load(path.read_text(encoding="utf-8")) or {}
    for key in SERVERS:
        if not isinstance(basic.get(key), dict):
            raise InputError(f"{path}: {key} is {basic.get(key)!r}, expected a mapping with host and port")
        basic[key]["host"] = host
    return basic


def _link_nltk_data(root: Path) -> None:
    """Offline, unstructured's loaders need NLTK data: link Chatchat's shipped copy into the root.

    Chatchat adds `$CHATCHAT_ROOT/data/nltk_data` to NLTK's path but `chatchat init` leaves it empty.
    """
    try:
        import chatchat
    except ImportError:
        return
    shipped = Path(chatchat.__file__).resolve().parent / "data" / "nltk_data"
    target = root / "data" / "nltk_data"
    if shipped.is_dir() and target.is_dir() and not any(target.iterdir()):
        for child in shipped.iterdir():
            (target / child.name).symlink_to(child, target_is_directory=child.is_dir())
        print(f"OK    linked Chatchat's NLTK data into {target}")

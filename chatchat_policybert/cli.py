"""`chatchat-policybert setup | doctor | serve | eval`: wire PolicyBERT into a Chatchat 0.3.1.3 root.

- `setup` merges the shipped `model_settings.yaml` / `kb_settings.yaml` into a root that
  `chatchat init` prepared, points the PolicyBERT platform at `--model`, creates the default
  knowledge base folder, then runs the doctor's checks.
- `doctor` lists what would stop PolicyBERT retrieval from working in a root, one line each.
- `serve` exposes the configured model as an OpenAI-compatible `/v1/embeddings`.
- `eval` measures retrieval on a corpus and questions (:mod:`chatchat_policybert.evaluation`).
- `rollback` restores the deployment from before the last installed `tune` (:mod:`chatchat_policybert.rollback`).
- `tune` (from the training package, through the ``chatchat_policybert.commands`` entry points) makes
  the retriever better on a knowledge base's own documents (``training.tune``).

Every bad input ends as one line `error: …` and exit status 2 (:mod:`chatchat_policybert.errors`).
"""

from __future__ import annotations

import argparse
import math
import os
import site
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .chatchat_root import (
    TARGET_COSINE,
    VS_TYPES,
    KbSettings,
    content_dir,
    cosine_cut,
    default_kb,
    index_size,
    kb_root,
    kb_settings,
    score_threshold_for,
    vector_store_dir,
)
from .dtypes import DTYPE_CHOICES
from .errors import InputError, run_cli
from .rollback import run_rollback
from .settings import PLATFORM_KEY, EmbeddingOptions, SettingsError, find_local_model, load_yaml, parse_hybrid, round_trip_yaml

SETTINGS_FILES = ("model_settings.yaml", "kb_settings.yaml")
PTH_NAME = "chatchat_policybert_hook.pth"
COMMAND_GROUP = "chatchat_policybert.commands"
PLUGIN_COMMANDS = {"tune": "from a knowledge base to a better deployed retriever: pairs, contrastive training, the gate "
                           "on the RAG path, calibration, install (training extras)"}
"""Commands found through entry points, with the help line `chatchat-policybert --help` shows for each."""
DENSE_ONLY_NOTE = "on pg Chatchat retrieves dense-only (its BM25 half exists only for FAISS)"


def shipped_settings_dir() -> Path:
    """Where the shipped YAML files are: packaged copies in a wheel, the repository root otherwise."""
    packaged = Path(__file__).resolve().parent / "chatchat_settings"
    if (packaged / SETTINGS_FILES[0]).is_file():
        return packaged
    return Path(__file__).resolve().parents[1]


def default_root() -> Path:
    """Chatchat's own rule: $CHATCHAT_ROOT, else the current directory."""
    return Path(os.environ.get("CHATCHAT_ROOT", ".")).resolve()


def threshold_cosine(score_threshold: float, store: str = "faiss") -> float:
    """Lowest cosine a hit of ``store`` may have under SCORE_THRESHOLD (see :func:`chatchat_root.cosine_cut`)."""
    return cosine_cut(score_threshold, store)


# ----------------------------------------------------------------------------- setup


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


def _policybert_block(model_settings: Any) -> Any:
    for platform in model_settings.get("MODEL_PLATFORMS") or []:
        if PLATFORM_KEY in platform:
            return platform[PLATFORM_KEY]
    raise SettingsError(f"the shipped model_settings.yaml has no platform with '{PLATFORM_KEY}'")


def run_setup(args: argparse.Namespace) -> int:
    """Merge the shipped settings into a root prepared by `chatchat init`, then check it."""
    root: Path = args.root
    missing = [name for name in SETTINGS_FILES if not (root / name).is_file()]
    if missing:
        raise InputError(f"{root} has no {', '.join(missing)}: run `CHATCHAT_ROOT={root} chatchat init` first")
    if args.kb is not None and args.calibrate is None:
        raise InputError("--kb only applies with --calibrate")
    if args.calibrate is not None and not args.calibrate.is_file():
        raise InputError(f"{args.calibrate}: question file not found")
    if args.pg_uri is not None and args.vs != "pg":
        raise InputError("--pg-uri is only used with --vs pg")
    if args.vs == "pg":
        from .pg_store import validate_uri

        if args.pg_uri is None:
            raise InputError("--vs pg needs --pg-uri postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE")
        validate_uri(args.pg_uri)
    yaml = round_trip_yaml()
    source = args.settings_dir
    for name in SETTINGS_FILES:
        shipped = yaml.load((source / name).read_text(encoding="utf-8"))
        if name == "model_settings.yaml":
            block = _policybert_block(shipped)
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
    _link_nltk_data(root)
    kb_dir = content_dir(root, default_kb(root))
    kb_dir.mkdir(parents=True, exist_ok=True)
    print(f"OK    knowledge base folder {kb_dir} (put documents here, then `chatchat kb -r -n {kb_dir.parent.name}`)")
    if args.calibrate is not None:
        calibrate_setup(root, args.kb or default_kb(root), args.calibrate)
    if args.no_check:
        return 0
    return report(diagnose(root, load_model=True))


def calibrate_setup(root: Path, kb: str, questions: Path) -> None:
    """``setup --calibrate``: choose the ensemble's weights and threshold on ``questions`` and record them."""
    from .calibration import calibrate_root, write_calibration

    calibration = calibrate_root(root, kb, questions, root / "logs")
    print(calibration.table())
    write_calibration(root, calibration)
    chosen = calibration.chosen
    print(f"OK    calibrated the FAISS ensemble on {calibration.questions} questions of {questions}: "
          f"{chosen.label} (written to model_settings.yaml and kb_settings.yaml)")


def _choose_store(kb_settings: Any, store: str, uri: str | None) -> None:
    """Point the kb_settings to merge at ``store``, with the threshold keeping cosine >= TARGET_COSINE there.

    The threshold is rounded up at the 4th decimal, so the cut stays at (not below) the target.
    """
    kb_settings["DEFAULT_VS_TYPE"] = store
    kb_settings["SCORE_THRESHOLD"] = math.ceil(score_threshold_for(TARGET_COSINE, store) * 1e4) / 1e4
    if uri is not None:
        kb_settings["kbs_config"] = {store: {"connection_uri": uri}}
    if store == "pg":
        print(f"NOTE  {DENSE_ONLY_NOTE}")


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


# ----------------------------------------------------------------------------- doctor


@dataclass
class Finding:
    level: str  # "OK", "WARN" or "ERROR"
    message: str


def hook_installed() -> Path | None:
    """The start-up `.pth` of this interpreter's environment, if present and not disabled."""
    from .chatchat_hook import DISABLE_ENV, switched_off

    if switched_off(DISABLE_ENV):
        return None
    for directory in [*site.getsitepackages(), site.getusersitepackages()]:
        candidate = Path(directory) / PTH_NAME
        if candidate.is_file():
            return candidate
    return None


def _llm_reachable(url: str) -> str | None:
    """None if `url`/models answers, else the reason."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/models", timeout=2) as response:
            response.read(1)
        return None
    except Exception as exc:  # any failure means "not usable now"
        return f"{type(exc).__name__}: {exc}"


def diagnose(root: Path, load_model: bool) -> list[Finding]:
    """Check a Chatchat root for everything PolicyBERT retrieval depends on."""
    findings: list[Finding] = []

    def add(level: str, message: str) -> None:
        findings.append(Finding(level, message))
    try:
        model_settings = load_yaml(root / "model_settings.yaml")
        settings = kb_settings(root)
    except SettingsError as exc:
        add("ERROR", f"{exc} (run `chatchat init` and `chatchat-policybert setup`)")
        return findings
    platforms = model_settings.get("MODEL_PLATFORMS") or []

    llms = {m: p for p in platforms for m in (p.get("llm_models") or []) if isinstance(p.get("llm_models"), list)}
    if not llms:
        add("ERROR", "no platform lists an LLM: every `chatchat` command dies with IndexError at import")
    default_llm = model_settings.get("DEFAULT_LLM_MODEL")
    if llms and default_llm not in llms:
        add("WARN", f"DEFAULT_LLM_MODEL '{default_llm}' is not listed; Chatchat falls back to '{next(iter(llms))}'")
    elif default_llm in llms:
        url = llms[default_llm].get("api_base_url", "")
        problem = _llm_reachable(url)
        if problem:
            add("WARN", f"LLM '{default_llm}' platform at {url} does not answer ({problem}); for Ollama: "
                f"`ollama serve` and `ollama pull {default_llm}`")
        else:
            add("OK", f"LLM '{default_llm}' platform answers at {url}")

    try:
        local = find_local_model(model_settings, None)
    except SettingsError as exc:
        add("ERROR", f"{exc}: DEFAULT_EMBEDDING_MODEL is not PolicyBERT")
        local = None
    pth = hook_installed()
    if pth is None:
        add("ERROR", f"import hook not installed in {sys.prefix} ({PTH_NAME} missing or CHATCHAT_POLICYBERT_HOOK=0): "
            "Chatchat will call api_base_url instead of loading the model")
    else:
        add("OK", f"import hook installed: {pth}")

    chunk = settings.chunk_size
    if local is not None:
        add("OK", f"embed model '{local.embed_models[0]}' served in-process by platform '{local.platform_name}'")
        if chunk + 2 > local.config.max_length:
            add("WARN", f"CHUNK_SIZE {chunk} + [CLS]/[SEP] exceeds max_length {local.config.max_length}: long chunks get cut")
        if load_model:
            findings.extend(_check_model(local, root))

    store = settings.vs_type
    if store not in VS_TYPES:
        add("WARN", f"DEFAULT_VS_TYPE '{store}': only {', '.join(VS_TYPES)} are checked here and rebuilt safely")
        return findings
    threshold = settings.score_threshold
    cosine = threshold_cosine(threshold, store)
    label = "FAISS" if store == "faiss" else store
    advice = f"{score_threshold_for(TARGET_COSINE, store):.4f} keeps cosine >= {TARGET_COSINE:.2f}"
    if cosine > 1.0:
        fallback = "retrieval is BM25 only" if store == "faiss" else "retrieval finds nothing"
        add("ERROR", f"SCORE_THRESHOLD {threshold} needs cosine >= {cosine:.2f}: no {label} hit can pass, "
            f"{fallback} ({advice})")
    elif cosine < 0.0:
        add("WARN", f"SCORE_THRESHOLD {threshold} keeps every {label} hit (cosine >= {cosine:.2f}; {advice})")
    else:
        add("OK", f"SCORE_THRESHOLD {threshold} keeps {label} hits with cosine >= {cosine:.2f}")

    findings.extend(_check_interrupted_swaps(root))
    if store == "faiss" and local is not None:
        findings.extend(_check_hybrid(model_settings, local.platform_name, threshold))
    if store == "faiss":
        findings.extend(_check_kb(root, settings, str(model_settings.get("DEFAULT_EMBEDDING_MODEL", "")), None))
        return findings
    from .pg_store import check_configured, check_server, connected

    add("OK", f"vector store pg: {DENSE_ONLY_NOTE}")
    unusable = check_configured(settings.pg_uri)
    if unusable:
        findings.extend(Finding(level, message) for level, message in unusable)
        return findings
    with connected(settings.pg_uri) as engine:  # one engine for every pg check
        server = [Finding(level, message) for level, message in check_server(engine)]
        findings.extend(server)
        if not any(f.level == "ERROR" for f in server):
            findings.extend(_check_kb(root, settings, "", engine))
    return findings


def _check_hybrid(model_settings: dict[str, Any], platform_name: str, threshold: float) -> list[Finding]:
    """The FAISS ensemble's weights, threshold and the dev metrics they were chosen on (the platform's ``hybrid``)."""
    from .calibration import describe

    platform = next(p for p in model_settings.get("MODEL_PLATFORMS") or [] if p.get("platform_name") == platform_name)
    try:
        hybrid = parse_hybrid(platform)
    except SettingsError as exc:
        return [Finding("ERROR", f"{exc}: the ensemble falls back to Chatchat's 0.5/0.5")]
    return [Finding(level, message) for level, message in describe(hybrid, threshold)]


def _check_model(local: Any, root: Path) -> list[Finding]:
    from .chatchat_hook import load_embeddings

    try:
        embeddings = load_embeddings(local.config, root, local.platform_name)
        vector = embeddings.embed_query("数据要素")
    except Exception as exc:
        return [Finding("ERROR", f"model of platform '{local.platform_name}' does not load: {exc}")]
    norm = math.sqrt(sum(x * x for x in vector))
    level = "OK" if abs(norm - 1.0) < 1e-3 else "ERROR"
    path = local.config.resolved_model_path(root)
    return [Finding(level, f"model {path} loads: dimension {len(vector)}, query vector norm {norm:.4f}")]


def _check_kb(root: Path, settings: KbSettings, embed_model: str, engine: Any | None) -> list[Finding]:
    """The default knowledge base's folder and vectors: in FAISS (``engine`` None) or in pg through ``engine``."""
    name = settings.default_kb
    kb_dir = kb_root(root) / name
    if not kb_dir.is_dir():
        return [Finding("ERROR", f"DEFAULT_KNOWLEDGE_BASE '{name}' has no folder {kb_dir}: the WebUI page crashes")]
    if engine is not None:
        from .pg_store import vectors_in

        vectors = vectors_in(engine, name)
        if not vectors:
            return [Finding("WARN", f"knowledge base '{name}' has no vectors in pg: run `chatchat kb -r -n {name}`")]
        return [Finding("OK", f"knowledge base '{name}' has {vectors} vectors in pg")]
    index = vector_store_dir(root, name, embed_model) / "index.faiss"
    if not index.is_file():
        return [Finding("WARN", f"knowledge base '{name}' has no FAISS index {index}: run `chatchat kb -r -n {name}`")]
    return [Finding("OK", f"knowledge base '{name}' has a FAISS index for '{embed_model}'")]


def _check_interrupted_swaps(root: Path) -> list[Finding]:
    """A ``.replaced`` folder of any knowledge base: a FAISS `kb -r` killed during its swap (see :func:`recover_swap`)."""
    from .kb_rebuild import interrupted_swaps, swap_finished

    findings = []
    for final, retired in interrupted_swaps(root):
        kb = final.parent.parent.name
        if swap_finished(final):
            findings.append(Finding("WARN", f"{retired} is left over by a `kb -r` killed after its swap ({final} is "
                                    f"the new index, {index_size(final)} vectors): remove it, or let the next "
                                    f"`chatchat kb -r -n {kb}` do so"))
        else:
            findings.append(Finding("ERROR", f"the index of '{kb}' is at {retired}, not served ({final} has no "
                                    f"vectors): a `kb -r` was killed during its swap; `chatchat kb -r -n {kb}` "
                                    f"puts it back first, or with Chatchat stopped: rm -rf '{final}' && "
                                    f"mv '{retired}' '{final}'"))
    return findings


def report(findings: Sequence[Finding]) -> int:
    """Print one line per finding; exit status 1 if any is an error."""
    for finding in findings:
        print(f"{finding.level:<5} {finding.message}")
    return 1 if any(f.level == "ERROR" for f in findings) else 0


def run_doctor(args: argparse.Namespace) -> int:
    return report(diagnose(args.root, load_model=not args.no_load))


# ----------------------------------------------------------------------------- serve


def run_serve(args: argparse.Namespace) -> int:
    """Serve the configured model as an OpenAI-compatible /v1/embeddings (see docs/deployment.md)."""
    import uvicorn

    from .chatchat_hook import load_embeddings
    from .server import (API_KEY_ENV, SHUTDOWN_GRACE_S, ServerLimits, create_app, header_timeout_protocol,
                         is_loopback, thread_local_counter)
    from .settings import LocalEmbeddingsConfig
    from .tokenization import PolicyBertTokenizer

    # Every flag is checked before the model loads: a typo costs no loading time.
    if not 0 < args.port <= 65535:
        raise InputError(f"--port {args.port}: expected a TCP port, 1..65535")
    if not math.isfinite(args.max_body_mb):
        raise InputError(f"--max-body-mb {args.max_body_mb}: expected a finite number of MiB")
    limits = ServerLimits(
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_inputs=args.max_inputs,
        max_input_tokens=args.max_input_tokens,
        max_request_tokens=args.max_request_tokens,
        max_batch=args.max_batch,
        batch_tokens=args.batch_tokens,
        max_wait_s=args.max_wait_ms / 1000.0,
        read_timeout_s=args.read_timeout,
    )
    if args.model_path is not None:
        config = LocalEmbeddingsConfig(model_path=str(args.model_path.resolve()), device=args.device or "cpu")
        platform, name = "command line", args.model_name or "policybert"
    else:
        local = find_local_model(load_yaml(args.root / "model_settings.yaml"), args.model_name)
        config, platform = local.config, local.platform_name
        name = args.model_name or local.embed_models[0]
    try:
        embeddings = load_embeddings(config, args.root, platform)
    except RuntimeError as exc:  # load_embeddings wraps the loader's one-line ModelDirError
        if isinstance(exc.__cause__, InputError):
            raise InputError(str(exc.__cause__)) from None
        raise
    tokenizer = getattr(embeddings, "tokenizer", None)
    if not isinstance(tokenizer, PolicyBertTokenizer):
        raise InputError(f"serve needs PolicyBertEmbeddings (its tokenizer counts tokens); {platform} configures "
                         f"{type(embeddings).__name__}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(args.host):
        print(f"WARNING: serving on {args.host}, reachable from other machines, WITHOUT an API key: anyone who can "
              f"reach this port can use the model; set {API_KEY_ENV} (or --api-key) or bind 127.0.0.1",
              file=sys.stderr, flush=True)
    dimension = len(embeddings.embed_documents(["维度"])[0])
    app = create_app(embeddings.embed_documents, thread_local_counter(tokenizer), name, dimension, limits, api_key)
    print(f"serving '{name}' (dimension {dimension}) at http://{args.host}:{args.port}/v1/embeddings"
          f"{' (API key required)' if api_key else ''}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=5,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S, http=header_timeout_protocol(limits))
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chatchat-policybert",
        description="Use PolicyBERT as the embedding model of a stock Langchain-Chatchat 0.3.1.3.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def with_root(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--root", type=Path, default=None,
                         help="Chatchat data root (default: $CHATCHAT_ROOT, else the current directory)")

    setup = commands.add_parser("setup", help="merge the PolicyBERT settings into a Chatchat root and check it",
                                description=run_setup.__doc__)
    with_root(setup)
    setup.add_argument("--model", type=Path, help="PolicyBERT (or BERT/bge) model directory to use")
    setup.add_argument("--device", help="torch device for the model, e.g. cpu or cuda:0")
    setup.add_argument("--dtype", choices=DTYPE_CHOICES, help="compute dtype (float32: the same vectors everywhere; auto: bfloat16 where the CPU/GPU has it)")
    setup.add_argument("--ollama-url", help="Ollama OpenAI-compatible base URL (default http://127.0.0.1:11434/v1)")
    setup.add_argument("--vs", choices=VS_TYPES,
                       help="vector store to use, with the SCORE_THRESHOLD keeping cosine >= 0.5 in it (default: the "
                            "shipped faiss). faiss: one index file per knowledge base, dense + BM25 retrieval; "
                            "pg: PostgreSQL + pgvector (needs --pg-uri and the [pg] extra), dense-only retrieval")
    setup.add_argument("--pg-uri", help="with --vs pg: Chatchat's kbs_config.pg.connection_uri, "
                                        "postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE")
    setup.add_argument("--settings-dir", type=Path, default=None,
                       help="folder with the model_settings.yaml/kb_settings.yaml to merge (default: the shipped ones)")
    setup.add_argument("--keep-other-platforms", action="store_true",
                       help="keep existing MODEL_PLATFORMS entries whose names the shipped file does not use")
    setup.add_argument("--no-check", action="store_true", help="skip the doctor's checks after merging")
    setup.add_argument("--calibrate", type=Path, metavar="FILE",
                       help="after `chatchat kb -r` with this model: choose the FAISS ensemble's BM25/dense weights and "
                            "SCORE_THRESHOLD on these held-out questions (training.pairs' dev.jsonl, or the evaluation's "
                            "JSONL questions) so the RAG path is at least as good there as BM25 or dense alone; records "
                            "them and their metrics in the settings (without it, setup keeps Chatchat's 0.5/0.5)")
    setup.add_argument("--kb", help="with --calibrate: the knowledge base to calibrate on (default: DEFAULT_KNOWLEDGE_BASE)")
    setup.set_defaults(func=run_setup)

    doctor = commands.add_parser("doctor", help="report what is wrong in a Chatchat root, one line per check")
    with_root(doctor)
    doctor.add_argument("--no-load", action="store_true", help="do not load the model (faster)")
    doctor.set_defaults(func=run_doctor)

    serve = commands.add_parser("serve", help="serve the model as an OpenAI-compatible /v1/embeddings")
    with_root(serve)
    serve.add_argument("--model-name", help="embed model name to serve (default: DEFAULT_EMBEDDING_MODEL of the root)")
    serve.add_argument("--model-path", type=Path, help="serve this model directory instead of the root's settings")
    serve.add_argument("--device", help="torch device with --model-path (default cpu)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only; set an API key before using another)")
    serve.add_argument("--port", type=int, default=9998, help="port to listen on (default 9998)")
    serve.add_argument("--max-batch", type=int, default=32, help="texts per model call across concurrent requests")
    serve.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a request waits for others to batch with")
    serve.add_argument("--max-inputs", type=int, default=2048, help="inputs per request before 413")
    serve.add_argument("--max-body-mb", type=float, default=8.0, help="request body size before 413")
    serve.add_argument("--max-input-tokens", type=int, default=8192, help="tokens per input before 413")
    serve.add_argument("--max-request-tokens", type=int, default=300_000, help="tokens per request before 413")
    serve.add_argument("--batch-tokens", type=int, default=EmbeddingOptions.model_fields["batch_tokens"].default,
                       help="tokens per model call; requests take turns in slices of this size")
    serve.add_argument("--read-timeout", type=float, default=10.0,
                       help="seconds a client may take to send its request headers, and again its body (408)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $POLICYBERT_API_KEY, "
                                         "which keeps the key out of the process list)")
    serve.set_defaults(func=run_serve)

    rollback = commands.add_parser("rollback", help="restore the model, settings and vectors from before the last "
                                   "installed `tune` (vectors rebuilt byte-identical)", description=run_rollback.__doc__)
    with_root(rollback)
    rollback.add_argument("--kb", help="knowledge base the tune ran on (default: DEFAULT_KNOWLEDGE_BASE)")
    rollback.add_argument("--run-dir", type=Path,
                          help="the tune's --out folder (default: ROOT/policybert_tune/KB), which holds previous/")
    rollback.set_defaults(func=run_rollback)

    # Parsed by the evaluation's own parser: `chatchat-policybert eval --help` shows its flags.
    commands.add_parser("eval", add_help=False, help="measure retrieval (BM25, dense, Chatchat) on a corpus and questions")
    # Commands other installed packages provide (entry-point group chatchat_policybert.commands): `tune` from training.
    for name in PLUGIN_COMMANDS:
        commands.add_parser(name, add_help=False, help=PLUGIN_COMMANDS[name])
    return parser


def plugin_command(name: str) -> Any:
    """The ``main(argv)`` of a command another package declares in the ``chatchat_policybert.commands`` group.

    Why an entry point: ``tune`` needs the training code, and this package never imports
    ``training`` (imports point one way); where the training extras are not installed the
    command is missing or cannot import, which is one error line saying what to install.
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=COMMAND_GROUP) if ep.name == name]
    advice = f"`chatchat-policybert {name}` needs the training package: pip install -c constraints.txt '.[chatchat,train]'"
    if not found:
        raise InputError(f"{advice} (no '{name}' in entry-point group {COMMAND_GROUP})")
    try:
        return found[0].load()
    except ImportError as exc:
        raise InputError(f"{advice} ({exc})") from None


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:
        from .evaluation.evaluate import main as evaluate

        return evaluate(argv[1:])
    if argv[:1] and argv[0] in PLUGIN_COMMANDS:
        return plugin_command(argv[0])(argv[1:])
    args = build_parser().parse_args(argv)
    args.root = (args.root or default_root()).resolve()
    if getattr(args, "settings_dir", "absent") is None:
        args.settings_dir = shipped_settings_dir()
    return args.func(args)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: every command, with bad input reported as one line (exit 2)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

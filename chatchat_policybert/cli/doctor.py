"""``chatchat-policybert doctor``: what would stop PolicyBERT retrieval from working in a root, one line each.

``setup`` runs the same checks after merging its settings.
"""

from __future__ import annotations

import argparse
import math
import site
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.root import (
    KbSettings,
    is_loopback,
    kb_root,
    kb_settings,
    server_hosts,
    vector_store_dir,
)
from chatchat_policybert.chatchat.settings import find_local_model, load_yaml
from chatchat_policybert.cli.common import add_root_argument
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.retrieval.hybrid import HybridConfig, parse_hybrid
from chatchat_policybert.stores import STORES
from chatchat_policybert.stores.base import TARGET_COSINE
from chatchat_policybert.stores.faiss_store import index_size

PTH_NAME = "chatchat_policybert_hook.pth"
PG_HYBRID_NOTE = (
    "on pg the plugin gives Chatchat's pg search the FAISS ensemble (BM25 + vectors, the platform's "
    "`hybrid` weights); without the plugin's hook Chatchat retrieves dense-only there"
)


def register(commands: Any) -> None:
    """Add ``doctor`` and its flags to the subcommands of the main parser."""
    doctor = commands.add_parser("doctor", help="report what is wrong in a Chatchat root, one line per check")
    add_root_argument(doctor)
    doctor.add_argument("--no-load", action="store_true", help="do not load the model (faster)")
    doctor.set_defaults(func=run_doctor)


@dataclass
class Finding:
    """One line of the doctor's report."""

    level: str  # "OK", "WARN" or "ERROR"
    message: str


def hook_installed() -> Path | None:
    """The start-up `.pth` of this interpreter's environment, if present and not disabled."""
    from chatchat_policybert.chatchat.switches import DISABLE_ENV, switched_off

    if switched_off(DISABLE_ENV):
        return None
    for directory in [*site.getsitepackages(), site.getusersitepackages()]:
        candidate = Path(directory) / PTH_NAME
        if candidate.is_file():
            return candidate
    return None


def llm_reachable(url: str) -> str | None:
    """None if the OpenAI-compatible server at `url` answers `/models`, else the reason (doctor and the demo ask)."""
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
        problem = llm_reachable(url)
        if problem:
            add(
                "WARN",
                f"LLM '{default_llm}' platform at {url} does not answer ({problem}); for Ollama: "
                f"`ollama serve` and `ollama pull {default_llm}`",
            )
        else:
            add("OK", f"LLM '{default_llm}' platform answers at {url}")

    try:
        local = find_local_model(model_settings, None)
    except SettingsError as exc:
        add("ERROR", f"{exc}: DEFAULT_EMBEDDING_MODEL is not PolicyBERT")
        local = None
    pth = hook_installed()
    if pth is None:
        add(
            "ERROR",
            f"import hook not installed in {sys.prefix} ({PTH_NAME} missing or CHATCHAT_POLICYBERT_HOOK=0): "
            "Chatchat will call api_base_url instead of loading the model",
        )
    else:
        add("OK", f"import hook installed: {pth}")

    for key, host in server_hosts(root).items():
        if not is_loopback(host):
            add(
                "WARN",
                f"{key}.host {host} in basic_settings.yaml: reachable from other machines (Chatchat's API has no "
                f"authentication); `chatchat-policybert setup --bind 127.0.0.1` keeps it on this machine",
            )

    chunk = settings.chunk_size
    if local is not None:
        add("OK", f"embed model '{local.embed_models[0]}' served in-process by platform '{local.platform_name}'")
        if chunk + 2 > local.config.max_length:
            add(
                "WARN",
                f"CHUNK_SIZE {chunk} + [CLS]/[SEP] exceeds max_length {local.config.max_length}: long chunks get cut",
            )
        if load_model:
            findings.extend(_check_model(local, root))

    store = settings.vs_type
    if store not in STORES:
        add("WARN", f"DEFAULT_VS_TYPE '{store}': only {', '.join(STORES)} are checked here and rebuilt safely")
        return findings
    threshold, vectors = settings.score_threshold, STORES[store]
    cosine, label = vectors.cosine_cut(threshold), vectors.label
    advice = f"{vectors.score_threshold_for(TARGET_COSINE):.4f} keeps cosine >= {TARGET_COSINE:.2f}"
    if cosine > 1.0:
        add(
            "ERROR",
            f"SCORE_THRESHOLD {threshold} needs cosine >= {cosine:.2f}: no {label} hit can pass, "
            f"{vectors.without_vectors} ({advice})",
        )
    elif cosine < 0.0:
        add("WARN", f"SCORE_THRESHOLD {threshold} keeps every {label} hit (cosine >= {cosine:.2f}; {advice})")
    else:
        add("OK", f"SCORE_THRESHOLD {threshold} keeps {label} hits with cosine >= {cosine:.2f}")

    findings.extend(_check_interrupted_swaps(root))
    analyzer = None
    if local is not None:
        hybrid_findings, analyzer = _check_hybrid(local.entry, threshold, store, root)
        findings.extend(hybrid_findings)
    if store == "faiss":
        embed_model = str(model_settings.get("DEFAULT_EMBEDDING_MODEL", ""))
        findings.extend(_check_kb(root, settings, embed_model, None, analyzer))
        return findings
    from chatchat_policybert.stores.pg_store import check_configured, check_server, connected

    add("OK", f"vector store pg: {PG_HYBRID_NOTE}")
    unusable = check_configured(settings.pg_uri)
    if unusable:
        findings.extend(Finding(level, message) for level, message in unusable)
        return findings
    with connected(settings.pg_uri) as engine:  # one engine for every pg check
        server = [Finding(level, message) for level, message in check_server(engine)]
        findings.extend(server)
        if not any(f.level == "ERROR" for f in server):
            findings.extend(_check_kb(root, settings, "", engine, analyzer))
    return findings


def _check_hybrid(platform: dict[str, Any], threshold: float, store: str, root: Path) -> tuple[list[Finding], Any]:
    """The ensemble's weights, threshold and the dev metrics they were chosen on (the platform's ``hybrid``), the
    BM25 analyzer it configures, and that analyzer (None where it cannot be built)."""
    from chatchat_policybert.deploy.calibration import describe

    try:
        hybrid = parse_hybrid(platform)
    except SettingsError as exc:
        return [Finding("ERROR", f"{exc}: the ensemble falls back to Chatchat's 0.5/0.5 and tokens")], None
    findings = [Finding(level, message) for level, message in describe(hybrid, threshold, store)]
    block = hybrid or HybridConfig()
    try:
        analyzer = block.get_analyzer(root)
    except InputError as exc:
        message = f"BM25 analyzer {block.analyzer_name}: {exc}; the ensemble falls back to Chatchat's tokens"
        return [*findings, Finding("ERROR", message)], None
    unset = "" if block.analyzer else " (the hybrid block has no `analyzer:`: Chatchat's own tokens)"
    findings.append(Finding("OK", f"BM25 analyzer {block.analyzer_name}{unset}: {analyzer.identity}"))
    return findings, analyzer


def _check_model(local: Any, root: Path) -> list[Finding]:
    from chatchat_policybert.chatchat.registry import load_embeddings

    try:
        embeddings = load_embeddings(local.config, root, local.platform_name)
        vector = embeddings.embed_query("数据要素")
    except Exception as exc:
        return [Finding("ERROR", f"model of platform '{local.platform_name}' does not load: {exc}")]
    norm = math.sqrt(sum(x * x for x in vector))
    level = "OK" if abs(norm - 1.0) < 1e-3 else "ERROR"
    path = local.config.resolved_model_path(root)
    return [Finding(level, f"model {path} loads: dimension {len(vector)}, query vector norm {norm:.4f}")]


def _check_kb(
    root: Path, settings: KbSettings, embed_model: str, engine: Any | None, analyzer: Any | None
) -> list[Finding]:
    """The default knowledge base's folder and vectors: in FAISS (``engine`` None, with the BM25 index saved beside
    them) or in pg through ``engine`` (BM25 is built in memory there)."""
    name = settings.default_kb
    kb_dir = kb_root(root) / name
    if not kb_dir.is_dir():
        return [Finding("ERROR", f"DEFAULT_KNOWLEDGE_BASE '{name}' has no folder {kb_dir}: the WebUI page crashes")]
    if engine is not None:
        from chatchat_policybert.stores.pg_store import vectors_in

        vectors = vectors_in(engine, name)
        if not vectors:
            return [Finding("WARN", f"knowledge base '{name}' has no vectors in pg: run `chatchat kb -r -n {name}`")]
        return [Finding("OK", f"knowledge base '{name}' has {vectors} vectors in pg")]
    index = vector_store_dir(root, name, embed_model) / "index.faiss"
    if not index.is_file():
        return [Finding("WARN", f"knowledge base '{name}' has no FAISS index {index}: run `chatchat kb -r -n {name}`")]
    return [
        Finding("OK", f"knowledge base '{name}' has a FAISS index for '{embed_model}'"),
        _check_saved_bm25(index.parent, name, analyzer),
    ]


def _check_saved_bm25(folder: Path, kb: str, analyzer: Any | None) -> Finding:
    """The BM25 index `kb -r` saved beside the FAISS index: a regular, readable file, as many chunks as the index
    has vectors, built by the configured analyzer — else the first question tokenises the whole KB."""
    from chatchat_policybert.retrieval.bm25_index import BM25_FILE, SavedIndexUnusable, saved_summary

    path = folder / BM25_FILE
    rebuild = f"run `chatchat kb -r -n {kb}`, or the first question of each process tokenises every chunk"
    try:
        built_by, chunks = saved_summary(path)
    except FileNotFoundError:
        return Finding("WARN", f"knowledge base '{kb}' has no saved BM25 index {path}: {rebuild}")
    except SavedIndexUnusable as exc:
        return Finding("WARN", f"saved BM25 index {path} is not used ({exc}): {rebuild}")
    vectors = index_size(folder)
    if chunks != vectors:
        return Finding("WARN", f"saved BM25 index {path} counts {chunks} chunks, the FAISS index {vectors}: {rebuild}")
    if analyzer is not None and built_by != analyzer.identity:
        return Finding(
            "WARN", f"saved BM25 index {path} was built by analyzer {built_by!r}, not the configured one: {rebuild}"
        )
    return Finding("OK", f"saved BM25 index {path}: {chunks} chunks, analyzer {built_by!r}")


def _check_interrupted_swaps(root: Path) -> list[Finding]:
    """A ``.replaced`` folder of any knowledge base: a FAISS `kb -r` killed during its swap (see
    :func:`recover_swap`)."""
    from chatchat_policybert.stores.faiss_store import interrupted_swaps, swap_finished

    findings = []
    for final, retired in interrupted_swaps(root):
        kb = final.parent.parent.name
        if swap_finished(final):
            findings.append(
                Finding(
                    "WARN",
                    f"{retired} is left over by a `kb -r` killed after its swap ({final} is "
                    f"the new index, {index_size(final)} vectors): remove it, or let the next "
                    f"`chatchat kb -r -n {kb}` do so",
                )
            )
        else:
            findings.append(
                Finding(
                    "ERROR",
                    f"the index of '{kb}' is at {retired}, not served ({final} has no "
                    f"vectors): a `kb -r` was killed during its swap; `chatchat kb -r -n {kb}` "
                    f"puts it back first, or with Chatchat stopped: rm -rf '{final}' && "
                    f"mv '{retired}' '{final}'",
                )
            )
    return findings


def report(findings: Sequence[Finding]) -> int:
    """Print one line per finding; exit status 1 if any is an error."""
    for finding in findings:
        print(f"{finding.level:<5} {finding.message}")
    return 1 if any(f.level == "ERROR" for f in findings) else 0


def run_doctor(args: argparse.Namespace) -> int:
    """Print the checks of ``--root``, one line each; exit status 1 if any is an error."""
    return report(diagnose(args.root, load_model=not args.no_load))

"""``chatchat-policybert doctor``'s checks as a function: what would stop PolicyBERT retrieval from working in a root,
one :class:`Finding` each (``setup`` runs the same checks after merging its settings; the command prints them).

The per-store checks (a FAISS index and its saved BM25 index, a PostgreSQL server) are the store's
(:meth:`chatchat_policybert.stores.base.Store.checks`); the lines for the ensemble's ``hybrid`` block are
:func:`describe`'s.
"""

from __future__ import annotations

import math
import site
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatchat_policybert.chatchat.config import kb_settings
from chatchat_policybert.chatchat.config import model_settings as read_model_settings
from chatchat_policybert.chatchat.root import is_loopback, server_hosts
from chatchat_policybert.chatchat.settings import find_local_model
from chatchat_policybert.errors import InputError, SettingsError
from chatchat_policybert.retrieval.hybrid import CHATCHAT_WEIGHTS, HybridConfig, parse_hybrid
from chatchat_policybert.stores import STORES, get_store
from chatchat_policybert.stores.base import TARGET_COSINE
from chatchat_policybert.stores.faiss_store import index_size

PTH_NAME = "chatchat_policybert_hook.pth"


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


def cpu_sharing() -> Finding:
    """What the plugin's processes run torch with on a CPU they share with the LLM: how long OpenMP's waiting threads
    spin, and the thread counts (docs/deployment.md, "Sharing the CPU with the LLM").

    Read from this process's environment, which is what ``chatchat start`` and ``kb -r`` inherit when started from
    the same shell or service unit: a variable set only for the service shows in its log, not here.
    """
    import os

    from chatchat_policybert.chatchat.switches import API_THREADS_DEFAULT, API_THREADS_ENV
    from chatchat_policybert.cpu import ONE_THREAD_TOKENS, PRESSURE_FILE, cpu_contended, describe

    short, how = describe()
    contention = (
        f"{PRESSURE_FILE}: {'contended now' if cpu_contended() else 'quiet now'}"
        if os.path.exists(PRESSURE_FILE)
        else f"no {PRESSURE_FILE} on this kernel: never"
    )
    api = os.environ.get(API_THREADS_ENV) or f"{API_THREADS_DEFAULT} (default; {API_THREADS_ENV} sets it)"
    others = os.environ.get("OMP_NUM_THREADS") or f"{len(os.sched_getaffinity(0))}, the cores (OMP_NUM_THREADS sets it)"
    advice = "" if short else "; threads that spin long slow every path when the LLM shares the CPU"
    return Finding(
        "OK" if short else "WARN",
        f"CPU sharing: {how}{advice}; torch threads: the API process {api}, "
        f"`kb -r`, workers, serve, eval and tune {others}; a question (at most {ONE_THREAD_TOKENS} tokens a "
        f"call) runs on one thread while the CPU is contended ({contention}), a document never",
    )


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
        model_settings = read_model_settings(root)
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
    findings.append(cpu_sharing())

    for key, host in server_hosts(root).items():
        if not is_loopback(host):
            add(
                "WARN",
                f"{key}.host {host} in basic_settings.yaml: reachable from other machines (Chatchat's API has no "
                f"authentication); `chatchat-policybert setup --bind 127.0.0.1` keeps it on this machine",
            )

    findings.extend(_check_capture(root))

    chunk = settings.chunk_size
    if local is not None:
        add("OK", f"embed model '{local.embed_models[0]}' served in-process by platform '{local.platform_name}'")
        add("OK", compute_dtype(local.config.dtype, local.config.device))
        if chunk + 2 > local.config.max_length:
            add(
                "WARN",
                f"CHUNK_SIZE {chunk} + [CLS]/[SEP] exceeds max_length {local.config.max_length}: long chunks get cut",
            )
        if load_model:
            embed_model = str(model_settings.get("DEFAULT_EMBEDDING_MODEL", ""))
            findings.extend(_check_model(local, root, settings, embed_model))

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
    embed_model = str(model_settings.get("DEFAULT_EMBEDDING_MODEL", ""))
    findings.extend(Finding(level, message) for level, message in vectors.checks(root, settings, embed_model, analyzer))
    return findings


def _check_capture(root: Path) -> list[Finding]:
    """Whether the API records its users' questions (``setup --capture``), where, for how long, and what the store
    holds; its file is opened only by its owner (another user gets the store's own one-line refusal)."""
    from chatchat_policybert.feedback.settings import read_capture
    from chatchat_policybert.feedback.store import open_store, store_location

    try:
        capture = read_capture(root)
    except SettingsError as exc:
        return [Finding("ERROR", f"{exc}: the API records no question; `chatchat-policybert setup --capture on|off`")]
    state = (
        f"capture on: the API records each question to a local knowledge base (redacted) and its hits, kept "
        f"{capture.retention_days} days"
        + (f", a share of {capture.swap:g} of RAG questions with their first source swapped" if capture.swap else "")
        if capture.enabled
        else "capture off: the API records no question (`chatchat-policybert setup --capture on` to let users say "
        "which source answered)"
    )
    try:
        location = store_location(root)
        store = open_store(root, create=False)
    except InputError as exc:  # the store's own refusal, or the settings that say where it is
        return [Finding("OK", state), Finding("WARN", f"feedback store: {exc}")]
    if store is None:
        return [Finding("OK", f"{state}; nothing recorded yet ({location})")]
    with store:
        total, marked = store.counts()
    return [Finding("OK", f"{state}; {location} holds {total} question(s), {marked} with feedback")]


def compute_dtype(dtype: str, device: str) -> str:
    """Which dtype the deployment's embeddings compute in, and why: ``auto`` resolves per machine, so the settings
    file alone does not say (and a KB moved to another machine may be embedded in another dtype than before)."""
    from chatchat_policybert.model.embeddings import BF16_CPU_FLAGS, auto_dtype, cpu_flags

    if dtype != "auto":
        why = "the same vectors bit for bit on every machine" if dtype == "float32" else "as configured (autocast)"
        return f"embeddings compute in {dtype} on {device} (dtype: {dtype}: {why})"
    resolved = auto_dtype(device)
    if device.startswith("cuda"):
        why = "the GPU supports bf16" if resolved == "bfloat16" else "no bf16-capable GPU"
    else:
        native = sorted(cpu_flags() & BF16_CPU_FLAGS)
        why = (
            f"this CPU multiplies bf16 natively ({', '.join(native)})"
            if native
            else "this CPU has no AMX/AVX-512-BF16, where bf16 would be emulated and slower"
        )
    reproducible = "`dtype: float32` for bit-reproducible vectors"
    return f"embeddings compute in {resolved} on {device} (dtype: auto: {why}; {reproducible})"


def _check_hybrid(platform: dict[str, Any], threshold: float, store: str, root: Path) -> tuple[list[Finding], Any]:
    """The ensemble's weights, threshold and the dev metrics they were chosen on (the platform's ``hybrid``), the
    BM25 analyzer it configures, and that analyzer (None where it cannot be built)."""
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


def _check_model(local: Any, root: Path, settings: Any, embed_model: str) -> list[Finding]:
    """The served model loads as Chatchat loads it and embeds a question, and check-model's check of its directory, on
    the towers just loaded where the configured class is PolicyBERT's (one load, not two: issue 43 item 11); then
    whether it made the default knowledge base's stored vectors (:func:`_check_stored_vectors`)."""
    from chatchat_policybert.chatchat.registry import load_embeddings
    from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
    from chatchat_policybert.model.loading import check_model_dir

    try:
        embeddings = load_embeddings(local.config, root, local.platform_name)
        vector = embeddings.embed_query("数据要素")
    except Exception as exc:
        return [Finding("ERROR", f"model of platform '{local.platform_name}' does not load: {exc}")]
    norm = math.sqrt(sum(x * x for x in vector))
    level = "OK" if abs(norm - 1.0) < 1e-3 else "ERROR"
    path = local.config.resolved_model_path(root)
    loaded = None
    if isinstance(embeddings, PolicyBertEmbeddings):
        loaded = (embeddings.model, embeddings.query_model, embeddings.tokenizer)
    return [
        Finding(level, f"model {path} loads: dimension {len(vector)}, query vector norm {norm:.4f}"),
        # check-model's check: its files belong together, or say it cannot tell
        Finding(*check_model_dir(path, loaded=loaded)),
        *_check_stored_vectors(embeddings, root, settings, embed_model, path),
    ]


def _check_stored_vectors(embeddings: Any, root: Path, settings: Any, embed_model: str, path: Path) -> list[Finding]:
    """ERROR where the served model did not make the default knowledge base's stored vectors (issue 52 SS1): one
    stored chunk embedded again must give its stored vector back (cosine above 0.999, the search's own check of an
    index), or every question is compared with vectors another model made. Nothing where the store or the knowledge
    base is missing or does not read: the store's checks below report that."""
    import numpy as np

    kb = settings.default_kb
    try:
        stored = get_store(settings.vs_type).vectors(root, kb, embed_model) if settings.vs_type in STORES else None
    except Exception:  # an unreachable database, a damaged index: reported by the store's own checks
        return []
    if not stored:
        return []
    text, vector = stored[0]
    fresh = np.asarray(embeddings.embed_documents([text])[0], dtype=np.float32)
    saved = np.frombuffer(vector, dtype=np.float32)
    cosine = float(fresh @ saved / (np.linalg.norm(fresh) * np.linalg.norm(saved)))
    if cosine > 0.999:
        return [Finding("OK", f"knowledge base '{kb}': its stored vectors were made by the served model")]
    return [
        Finding(
            "ERROR",
            f"knowledge base '{kb}': its vectors were not made by the served model {path} (cosine {cosine:.3f}): "
            f"serve the model that made them, or `chatchat kb -r -n {kb}` re-embeds them with this one",
        )
    ]


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


def ensemble_label(store: str) -> str:
    """How ``doctor`` and ``setup`` name the ensemble of a store (``faiss``/``pg``)."""
    return f"{get_store(store).label} ensemble"


def describe(hybrid: Any, configured_threshold: float, store: str = "faiss") -> list[tuple[str, str]]:
    """``doctor``'s lines for a platform's ``hybrid`` block (a
    :class:`~chatchat_policybert.retrieval.hybrid.HybridConfig` or None)."""
    if hybrid is None or (hybrid.calibration is None and hybrid.weights == CHATCHAT_WEIGHTS):
        return [
            (
                "OK",
                f"{ensemble_label(store)}: Chatchat's weights "
                f"BM25 {CHATCHAT_WEIGHTS[0]:g} / dense {CHATCHAT_WEIGHTS[1]:g}, "
                f"not calibrated (`chatchat-policybert setup --calibrate DEV.jsonl` after `chatchat kb -r`)",
            )
        ]
    lines = [
        (
            "OK",
            f"{ensemble_label(store)}: weights BM25 {hybrid.bm25_weight:g} / dense {hybrid.dense_weight:g}, "
            f"SCORE_THRESHOLD {configured_threshold:g}",
        )
    ]
    info = hybrid.calibration or {}
    metrics = info.get("metrics") or {}
    key = _mrr_key(metrics)
    if hybrid.dense_weight == 0 or get_store(store).cosine_cut(configured_threshold) > 1.0:
        scores = {name: (metrics.get(name) or {}).get(key) for name in ("dense", "bm25")}
        measured = (
            f"; on the calibration questions the vectors alone scored {key} {scores['dense']:.3f}, BM25 alone "
            f"{scores['bm25']:.3f}"
            if None not in scores.values()
            else ""
        )
        lines.append(
            (
                "OK",
                "the ensemble is BM25 alone (dense weight 0, or no vector hit passes SCORE_THRESHOLD): the served "
                f"model's vectors are not used by the RAG path{measured}",
            )
        )
    if metrics:
        shown = ", ".join(f"{name} {values.get(key, float('nan')):.3f}" for name, values in metrics.items())
        lines.append(
            (
                "OK",
                f"calibrated {info.get('date', '?')} on {info.get('questions', '?')} questions of "
                f"{info.get('source', '?')} (KB {info.get('kb', '?')}, top_k {info.get('top_k', '?')}): {key} {shown}",
            )
        )
    if hybrid.score_threshold is not None and not math.isclose(hybrid.score_threshold, configured_threshold):
        lines.append(
            (
                "WARN",
                f"SCORE_THRESHOLD {configured_threshold:g} is not the {hybrid.score_threshold:g} the weights "
                "were calibrated with: calibrate again or set it back in kb_settings.yaml",
            )
        )
    return lines


def _mrr_key(metrics: dict[str, dict[str, float]]) -> str:
    """The MRR the calibration recorded (``MRR@10``: the evaluation's cut), as its rows name it."""
    return next((name for values in metrics.values() for name in values if name.startswith("MRR@")), "MRR@?")

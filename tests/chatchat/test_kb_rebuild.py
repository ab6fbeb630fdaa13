"""`chatchat kb -r` in a real root builds the FAISS index with PolicyBERT through the import hook."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import faiss
import numpy as np
from chatchat_deploy import BIN, KB_NAME, N_DOCUMENTS, Deployment, run
from ollama_standin import REPLY

from chatchat_policybert.chatchat.config import served_platform
from chatchat_policybert.configure.doctor import diagnose

CHUNKS_SCRIPT = f"""
import json, os
from chatchat.server.knowledge_base.utils import KnowledgeFile
names = sorted(os.listdir(os.path.join(os.environ["CHATCHAT_ROOT"], "data/knowledge_base/{KB_NAME}/content")))
print(json.dumps([d.page_content for n in names for d in KnowledgeFile(n, "{KB_NAME}").file2text()]))
"""


def load_index(deployment: Deployment) -> tuple[np.ndarray, list[str]]:
    index = faiss.read_index(str(deployment.vector_store / "index.faiss"))
    with (deployment.vector_store / "index.pkl").open("rb") as handle:
        docstore, index_to_id = pickle.load(handle)
    vectors = index.reconstruct_n(0, index.ntotal)
    texts = [docstore.search(index_to_id[i]).page_content for i in range(index.ntotal)]
    return vectors, texts


def test_index_has_one_vector_per_chatchat_chunk(deployment: Deployment):
    # Chatchat's own loader and splitter, run separately, decide what the chunks are.
    result = run([str(BIN / "python"), "-c", CHUNKS_SCRIPT], deployment.env)
    assert result.returncode == 0, result.stderr[-3000:]
    chunks = json.loads(result.stdout.strip().splitlines()[-1])
    _, texts = load_index(deployment)
    assert len(chunks) > len(list(deployment.content_dir.iterdir()))  # really chunked
    assert Counter(texts) == Counter(chunks)


def test_index_vectors_are_policybert_vectors(deployment: Deployment):
    vectors, texts = load_index(deployment)
    hidden_size = json.loads((deployment.model_dir / "config.json").read_text())["hidden_size"]
    assert vectors.shape == (len(texts), hidden_size)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    expected = np.asarray(deployment.embeddings().embed_documents(texts), dtype=np.float32)
    assert np.abs(vectors - expected).max() <= 1e-5


def test_setup_writes_dtype_auto_and_doctor_says_what_it_computes_in(deployment: Deployment):
    native = bool(set(Path("/proc/cpuinfo").read_text().split()) & {"amx_bf16", "avx512_bf16"})
    assert served_platform(deployment.root).config.dtype == "auto"
    lines = [f.message for f in diagnose(deployment.root, load_model=False) if f.message.startswith("embeddings ")]
    [line] = lines
    assert line.startswith(f"embeddings compute in {'bfloat16' if native else 'float32'} on cpu (dtype: auto: ")
    assert ("this CPU multiplies bf16 natively" in line) == native
    assert line.endswith("`dtype: float32` for bit-reproducible vectors)")


def test_a_kb_embedded_in_one_dtype_answers_questions_embedded_in_the_other(deployment: Deployment):
    """Decided in issue 44: no refusal and no rebuild when the dtype changes (``auto`` on another machine, or the
    setting edited): bf16 autocast vectors stay within cosine 0.999 of float32's, on the index's chunks and on
    questions, so the store's cosine cut and ranking carry over (docs/speed.md measures the ranking on e5)."""
    vectors, texts = load_index(deployment)  # embedded as the deployment computes: dtype auto
    fp32 = deployment.embeddings(dtype="float32")
    bf16 = deployment.embeddings(dtype="bfloat16")
    doc32 = np.asarray(fp32.embed_documents(texts), dtype=np.float32)
    doc16 = np.asarray(bf16.embed_documents(texts), dtype=np.float32)
    assert (np.sum(vectors * doc32, axis=1) >= 0.999).all()
    assert (np.sum(doc16 * doc32, axis=1) >= 0.999).all()
    questions = ["数据要素市场化配置改革", "公共数据授权运营", "数字经济发展规划"]
    q32 = np.asarray([fp32.embed_query(q) for q in questions])
    q16 = np.asarray([bf16.embed_query(q) for q in questions])
    assert (np.sum(q32 * q16, axis=1) >= 0.999).all()
    assert bf16.embed_query(questions[0]) != fp32.embed_query(questions[0])  # really another dtype


def test_demo_reports_index_passages_and_rag_answer(deployment: Deployment, policies):
    log = deployment.demo_log
    vectors, _ = load_index(deployment)
    assert f"[kb] {KB_NAME}: {len(vectors)} chunks embedded by PolicyBERT" in log
    assert log.count("\nQ: ") == 3 and "  5. [" in log
    assert "RAG answer from qwen2.5:7b" in log and REPLY in log
    assert "unavailable" not in log


def test_demo_log_says_how_far_kb_r_is(deployment: Deployment):
    # The demo runs `kb -r` with its output captured (not a terminal) and relays the rebuild's progress lines.
    n = len(load_index(deployment)[0])
    log = deployment.demo_log
    assert f"[progress] kb -r {KB_NAME}: splitting: 0/{N_DOCUMENTS} files" in log
    assert f"[progress] kb -r {KB_NAME}: 0/{n} chunks, 0% [" in log
    assert f"[progress] kb -r {KB_NAME}: {n}/{n} chunks, 100% [" in log


def test_kb_r_piped_prints_plain_progress_lines(deployment: Deployment, tmp_path):
    """`chatchat kb -r` with stdout and stderr not a terminal: one plain line per refresh (no carriage returns),
    chunks done out of the total, rate and time left."""
    root = deployment.copy_root(tmp_path / "root")
    result = run([str(BIN / "chatchat"), "kb", "-r", "-n", KB_NAME], {**deployment.env, "CHATCHAT_ROOT": str(root)})
    assert result.returncode == 0, result.stderr[-3000:]
    n = faiss.read_index(str(root / deployment.vector_store.relative_to(deployment.root) / "index.faiss")).ntotal
    assert n > N_DOCUMENTS
    lines = [line for line in result.stderr.split("\n") if "[progress]" in line]
    chunk_lines = [line for line in lines if line.startswith(f"[progress] kb -r {KB_NAME}: ") and "chunks" in line]
    assert chunk_lines[0].startswith(f"[progress] kb -r {KB_NAME}: 0/{n} chunks, 0% [00:")
    assert chunk_lines[-1].startswith(f"[progress] kb -r {KB_NAME}: {n}/{n} chunks, 100% [")
    assert chunk_lines[-1].endswith(("chunks/s]", "s/chunks]"))  # the rate, or its inverse when under 1/s
    assert not any("\r" in line for line in lines)

"""`chatchat kb -r` in a real root builds the FAISS index with PolicyBERT through the import hook."""

from __future__ import annotations

import json
import pickle
from collections import Counter

import faiss
import numpy as np
from chatchat_deploy import BIN, KB_NAME, Deployment, run
from ollama_standin import REPLY

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings

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
    expected = np.asarray(PolicyBertEmbeddings(str(deployment.model_dir)).embed_documents(texts), dtype=np.float32)
    assert np.abs(vectors - expected).max() <= 1e-5


def test_demo_reports_index_passages_and_rag_answer(deployment: Deployment, policies):
    log = deployment.demo_log
    vectors, _ = load_index(deployment)
    assert f"[kb] {KB_NAME}: {len(vectors)} chunks embedded by PolicyBERT" in log
    assert log.count("\nQ: ") == 3 and "  5. [" in log
    assert "RAG answer from qwen2.5:7b" in log and REPLY in log
    assert "unavailable" not in log

"""`chatchat-policybert serve`'s OpenAI-compatible /v1/embeddings with the tiny PolicyBERT."""

from __future__ import annotations

import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import requests
import uvicorn
from chatchat_deploy import free_port
from fastapi.testclient import TestClient

from chatchat_policybert.embeddings import PolicyBertEmbeddings
from chatchat_policybert.server import ServerLimits, create_app

MODEL = "policybert"


@pytest.fixture(scope="module")
def embeddings(tiny_model) -> PolicyBertEmbeddings:
    return PolicyBertEmbeddings(str(tiny_model))


@pytest.fixture(scope="module")
def texts(policies) -> list[str]:
    return [p.content[i : i + 60] for p in policies for i in range(0, 600, 120)]


@pytest.fixture(scope="module")
def limits() -> ServerLimits:
    return ServerLimits(max_body_bytes=64 * 1024, max_inputs=64, max_batch=16, max_wait_s=0.005)


@pytest.fixture(scope="module")
def client(embeddings, limits):
    app = create_app(embeddings.embed_documents, MODEL, embeddings.dimension, limits)
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def model_calls() -> list[int]:
    """Sizes of the batches the live server handed to the model."""
    return []


@pytest.fixture(scope="module")
def live_url(embeddings, limits, model_calls):
    """The app under a real uvicorn on a loopback port, for concurrent clients."""
    port = free_port()

    def embed(texts: list[str]) -> list[list[float]]:
        model_calls.append(len(texts))
        return embeddings.embed_documents(texts)

    app = create_app(embed, MODEL, embeddings.dimension, limits)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


def test_float_and_base64_match_embed_documents(client, embeddings, texts):
    expected = np.asarray(embeddings.embed_documents(texts), dtype=np.float32)
    as_float = client.post("/v1/embeddings", json={"model": MODEL, "input": texts}).json()
    as_base64 = client.post("/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64"}).json()
    floats = np.asarray([d["embedding"] for d in as_float["data"]], dtype=np.float32)
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in as_base64["data"]])
    assert [d["index"] for d in as_float["data"]] == list(range(len(texts)))
    np.testing.assert_array_equal(floats, expected)
    np.testing.assert_array_equal(decoded, expected)


def test_single_string_input(client, embeddings, texts):
    data = client.post("/v1/embeddings", json={"model": MODEL, "input": texts[0]}).json()["data"]
    assert len(data) == 1
    np.testing.assert_array_equal(np.float32(data[0]["embedding"]), np.float32(embeddings.embed_documents(texts[:1])[0]))


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "policybert", "input": [1, 2]}', 422, "input"),
        (b'{"model": "policybert"}', 422, "input"),
        (b'{"model": "policybert", "input": []}', 422, "empty"),
        (b'{"model": "policybert", "input": "x", "encoding_format": "int8"}', 422, "encoding_format"),
        (b'{"model": "other", "input": "x"}', 404, "other"),
        (b'{"model": "policybert", "input": "x", "dimensions": 7}', 400, "dimensions"),
    ],
)
def test_bad_requests_get_4xx_with_message(client, body, status, fragment):
    response = client.post("/v1/embeddings", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]


def test_payload_limits_give_413(client, limits):
    too_many = client.post("/v1/embeddings", json={"model": MODEL, "input": ["政策"] * (limits.max_inputs + 1)})
    assert too_many.status_code == 413 and str(limits.max_inputs) in too_many.json()["error"]["message"]
    too_big = client.post("/v1/embeddings", json={"model": MODEL, "input": "数" * limits.max_body_bytes})
    assert too_big.status_code == 413 and "exceeds" in too_big.json()["error"]["message"]
    assert client.get("/health").json()["status"] == "ok"


def test_openai_client_one_text_per_request_concurrently(live_url, embeddings, texts, model_calls, limits):
    """Chatchat's LocalAIEmbeddings pattern: the OpenAI client, one text per call, from many threads."""
    expected = np.asarray(embeddings.embed_documents(texts), dtype=np.float32)
    client = openai.OpenAI(base_url=live_url, api_key="EMPTY", max_retries=0)

    def one(i: int) -> tuple[int, np.ndarray]:
        response = client.embeddings.create(model=MODEL, input=[texts[i % len(texts)]])
        return i, np.asarray(response.data[0].embedding, dtype=np.float32)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one, range(8 * 200)))  # 8 clients x 200 requests
    for i, vector in results:
        np.testing.assert_allclose(vector, expected[i % len(texts)], atol=1e-5)
    # Concurrent one-text requests were embedded together, never more than max_batch at once.
    assert sum(model_calls) == len(results) and len(model_calls) < len(results)
    assert max(model_calls) <= limits.max_batch
    assert requests.get(live_url.removesuffix("/v1") + "/health", timeout=5).ok


def test_chatchat_localai_embeddings_against_the_server(live_url, embeddings, texts, tmp_path, monkeypatch):
    """Without the hook, Chatchat reaches the server through its own LocalAIEmbeddings client."""
    monkeypatch.setenv("CHATCHAT_ROOT", str(tmp_path))  # Chatchat writes logs under its root at import
    from chatchat.server.localai_embeddings import LocalAIEmbeddings

    client = LocalAIEmbeddings(model=MODEL, openai_api_base=live_url, openai_api_key="EMPTY")
    got = np.asarray(client.embed_documents(texts), dtype=np.float32)
    np.testing.assert_allclose(got, np.asarray(embeddings.embed_documents(texts), dtype=np.float32), atol=1e-5)

"""`chatchat-policybert serve`'s OpenAI-compatible /v1/embeddings with the tiny PolicyBERT."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import openai
import pytest
import requests
import uvicorn
from chatchat_deploy import free_port
from fastapi.testclient import TestClient

from chatchat_policybert.cli import build_parser
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.serving.app import create_app, serving_app, thread_local_counter
from chatchat_policybert.serving.limits import CHARS_PER_TOKEN, ServerLimits
from chatchat_policybert.serving.protocol import header_timeout_protocol
from tests.support.fast_loop import slow_fixture

MODEL = "policybert"


@pytest.fixture(scope="module")
def embeddings(tiny_model) -> PolicyBertEmbeddings:
    return PolicyBertEmbeddings(str(tiny_model))


@pytest.fixture(scope="module")
def texts(policies) -> list[str]:
    return [p.content[i : i + 60] for p in policies for i in range(0, 600, 120)]


@pytest.fixture(scope="module")
def limits() -> ServerLimits:
    return ServerLimits(
        max_body_mb=1 / 16,
        max_inputs=64,
        max_batch=16,
        max_wait_ms=5.0,
        max_input_tokens=1024,
        max_request_tokens=8192,
        batch_tokens=1024,
        read_timeout=3.0,
    )


@pytest.fixture(scope="module")
def client(embeddings, limits):
    app = create_app(
        embeddings.embed_documents, thread_local_counter(embeddings.tokenizer), MODEL, embeddings.dimension, limits
    )
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def model_calls() -> list[int]:
    """Sizes of the batches the live server handed to the model."""
    return []


@contextmanager
def served(app, limits: ServerLimits) -> Iterator[str]:
    """``app`` under a real uvicorn on a loopback port with `serve`'s protocol; yields the /v1 URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=header_timeout_protocol(limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


@slow_fixture(scope="module")
def live_url(embeddings, limits, model_calls):
    """The app under a real uvicorn on a loopback port, for concurrent clients."""

    def embed(texts: list[str]) -> list[list[float]]:
        model_calls.append(len(texts))
        return embeddings.embed_documents(texts)

    app = create_app(embed, thread_local_counter(embeddings.tokenizer), MODEL, embeddings.dimension, limits)
    with served(app, limits) as url:
        yield url


def test_serve_flags_are_the_limits_fields():
    """Each limit is declared once: `serve`'s flags are ServerLimits' fields, with its defaults, in the flags' units."""
    parse = build_parser().parse_args
    assert ServerLimits.from_arguments(parse(["serve"])) == ServerLimits()
    given = ServerLimits.from_arguments(
        parse(["serve", "--max-body-mb", "0.5", "--max-wait-ms", "0", "--read-timeout", "2"])
    )
    assert (given.max_body_bytes, given.max_wait_s, given.read_timeout) == (512 * 1024, 0.0, 2.0)


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
    np.testing.assert_array_equal(
        np.float32(data[0]["embedding"]), np.float32(embeddings.embed_documents(texts[:1])[0])
    )


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


# --- issue #15: what a hostile or careless client must not be able to do ----------------------


def raw_request(url: str, head: bytes, body_parts: list[bytes], timeout: float = 8.0) -> str:
    """Send a hand-made HTTP request (headers, then ``body_parts``, never finished) and return the status line.

    The body is left incomplete on purpose: a server that answers must have decided before reading it all.
    """
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except OSError:  # the server closed the connection after answering: that is the point
            pass
        try:
            return sock.recv(65536).split(b"\r\n", 1)[0].decode("latin-1")
        except TimeoutError:
            return "no answer"


def test_chunked_body_over_the_limit_is_refused_while_reading(live_url, limits):
    """Item 1: a chunked body with no Content-Length is counted as it arrives, not buffered first."""
    chunk = b"x" * 16384
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (2 * limits.max_body_bytes // len(chunk))
    head = (
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    status = raw_request(live_url, head, parts, timeout=limits.read_timeout - 1)
    assert " 413 " in status, status
    assert requests.get(live_url.removesuffix("/v1") + "/health", timeout=5).ok


def test_stalled_body_times_out(live_url, limits):
    """Item 7: a client that declares a body and never sends it holds the request at most read_timeout."""
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    start = time.monotonic()
    status = raw_request(live_url, head, [b'{"model": '], timeout=limits.read_timeout + 5)
    assert " 408 " in status, status
    assert time.monotonic() - start < limits.read_timeout + 5


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_accepted(client, content_type):
    """Item 7: a web page can make a browser POST text/plain cross-origin without a preflight."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = client.post("/v1/embeddings", content=b'{"model": "policybert", "input": "x"}', headers=headers)
    assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]
    ok = client.post(
        "/v1/embeddings",
        content=b'{"model": "policybert", "input": "x"}',
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


def test_api_key(embeddings):
    """Item 7: with a key, every /v1 route needs ``Authorization: Bearer <key>``; /health stays open."""
    app = create_app(
        embeddings.embed_documents,
        thread_local_counter(embeddings.tokenizer),
        MODEL,
        embeddings.dimension,
        api_key="s3cret-key",
    )
    body = {"model": MODEL, "input": "数据"}
    with TestClient(app) as keyed:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret-key"},
            {"Authorization": "Basic s3cret-key"},
        ):
            refused = keyed.post("/v1/embeddings", json=body, headers=headers)
            assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
            assert keyed.get("/v1/models", headers=headers).status_code == 401
        good = {"Authorization": "Bearer s3cret-key"}
        assert keyed.post("/v1/embeddings", json=body, headers=good).status_code == 200
        assert keyed.get("/v1/models", headers=good).json()["data"][0]["id"] == MODEL
        assert keyed.get("/health").status_code == 200


def test_lone_surrogate_is_a_4xx_naming_the_item(client, embeddings):
    """Item 5: JSON can carry "\\ud800"; it is no text, and the error says which input holds it."""
    response = client.post(
        "/v1/embeddings",
        content=b'{"model": "policybert", "input": ["ok", "a\\ud800b"]}',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert "input 1" in response.json()["error"]["message"] and "surrogate" in response.json()["error"]["message"]
    with pytest.raises(ValueError, match="text 1 has a lone surrogate"):
        embeddings.embed_documents(["ok", "a\ud800b"])


def test_usage_counts_tokens_not_characters(client, embeddings):
    """Extra: ``usage.prompt_tokens`` is what the tokenizer makes of the inputs ([CLS]/[SEP] included)."""
    texts = ["数据安全", "数 据 安 全 政 策"]
    usage = client.post("/v1/embeddings", json={"model": MODEL, "input": texts}).json()["usage"]
    expected = sum(len(embeddings.tokenizer.tokenizer(t)["input_ids"]) for t in texts)
    assert usage["prompt_tokens"] == expected != sum(map(len, texts))


def test_token_caps_give_413(client, limits):
    """Item 2: the work one request may ask for is capped in tokens, per input and per request."""
    long_input = client.post("/v1/embeddings", json={"model": MODEL, "input": ["数据", "政" * limits.max_input_tokens]})
    assert long_input.status_code == 413
    assert "input[1]" in long_input.json()["error"]["message"] and str(limits.max_input_tokens) in long_input.text
    many = ["政" * (limits.max_input_tokens - 10)] * (limits.max_request_tokens // limits.max_input_tokens + 1)
    too_much = client.post("/v1/embeddings", json={"model": MODEL, "input": many})
    assert too_much.status_code == 413 and str(limits.max_request_tokens) in too_much.json()["error"]["message"]


def test_small_request_waits_one_model_call_behind_a_large_one(embeddings, limits, texts):
    """Item 2: a request arriving while a large one runs is in the very next model call."""
    calls: list[list[str]] = []
    first_call_running, small_queued = threading.Event(), threading.Event()

    def embed(batch: list[str]) -> list[list[float]]:
        calls.append(batch)
        if len(calls) == 1:
            first_call_running.set()
            assert small_queued.wait(10)
        return embeddings.embed_documents(batch)

    app = create_app(embed, thread_local_counter(embeddings.tokenizer), MODEL, embeddings.dimension, limits)
    large = [t * 8 for t in texts][: limits.max_inputs]  # about 480 tokens each: many slices
    with TestClient(app) as test_client, ThreadPoolExecutor(2) as pool:
        big = pool.submit(test_client.post, "/v1/embeddings", json={"model": MODEL, "input": large})
        assert first_call_running.wait(30)
        small = pool.submit(test_client.post, "/v1/embeddings", json={"model": MODEL, "input": "小请求"})
        time.sleep(0.5)  # the small request is parsed and queued while the first call is still blocked
        small_queued.set()
        assert small.result(30).status_code == 200 and big.result(60).status_code == 200
    assert len(calls) > 3, "the large request should have been cut into slices"
    assert "小请求" in calls[1]
    got = np.asarray([d["embedding"] for d in big.result().json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, np.asarray(embeddings.embed_documents(large), dtype=np.float32), atol=1e-5)


# --- issue #23: bounded work per request, every error JSON and small ---------------------------


def post_raw(client, body: bytes):
    return client.post("/v1/embeddings", content=body, headers={"Content-Type": "application/json"})


def test_errors_never_echo_the_input(client, limits):
    """Item 1: 20,000 integers as ``input`` (under the body limit) were a 1 MB 422 listing each; now
    a small 413 before validation, and a 422 over max_inputs bad items lists five and counts the rest."""
    over = post_raw(client, b'{"model": "policybert", "input": [%s]}' % b",".join([b"1"] * 20_000))
    assert over.status_code == 413 and "20000 inputs" in over.json()["error"]["message"]
    assert len(over.content) < 500, len(over.content)
    bad_items = post_raw(client, b'{"model": "policybert", "input": [%s]}' % b",".join([b"7"] * limits.max_inputs))
    message = bad_items.json()["error"]["message"]
    assert bad_items.status_code == 422 and "input.list[str].0" in message and "more problem(s)" in message
    assert len(bad_items.content) < 1000, len(bad_items.content)
    long_name = client.post("/v1/embeddings", json={"model": "m" * 50_000, "input": "x"})
    assert long_name.status_code == 404 and len(long_name.content) < 1000, len(long_name.content)


def test_long_words_are_capped_and_sliced_by_characters(embeddings):
    """Item 2: one "word" without spaces is a single [UNK] token however long; its characters are
    capped before tokenising (413), and a model call holds at most ``batch_tokens`` x CHARS_PER_TOKEN
    characters of such words, so the turn-taking bound holds for them too."""
    limits = ServerLimits(max_input_tokens=512, max_request_tokens=2048, batch_tokens=256, max_batch=16)
    calls: list[list[str]] = []

    def embed(batch: list[str]) -> list[list[float]]:
        calls.append(batch)
        return embeddings.embed_documents(batch)

    app = create_app(embed, thread_local_counter(embeddings.tokenizer), MODEL, embeddings.dimension, limits)
    with TestClient(app) as test_client:
        one_word = test_client.post(
            "/v1/embeddings", json={"model": MODEL, "input": ["数据", "a" * (limits.max_input_chars + 1)]}
        )
        assert one_word.status_code == 413, one_word.text
        assert "input[1]" in one_word.text and f"{limits.max_input_chars + 1} characters" in one_word.text
        digits = ["10" * (limits.max_input_chars // 2)] * (limits.max_request_chars // limits.max_input_chars + 1)
        many = test_client.post("/v1/embeddings", json={"model": MODEL, "input": digits})
        assert many.status_code == 413 and "characters" in many.text and str(limits.max_request_chars) in many.text
        assert not calls  # refused before any model call
        words = ["a" * 1000] * 16  # 3 tokens each, 1,000 characters of tokenising and matching each
        answer = test_client.post("/v1/embeddings", json={"model": MODEL, "input": words})
        assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 16 * 3
    assert max(sum(map(len, call)) for call in calls) <= limits.batch_tokens * CHARS_PER_TOKEN
    assert sum(map(len, calls)) == 16


@pytest.mark.slow  # a real uvicorn (served)
def test_abandoned_request_stops_between_model_calls(embeddings, texts):
    """Item 3: a client that disconnects while its request runs costs at most the model call under way."""
    limits = ServerLimits(max_batch=1, read_timeout=5.0)
    calls: list[int] = []
    first = threading.Event()

    def embed(batch: list[str]) -> list[list[float]]:
        calls.append(len(batch))
        first.set()
        time.sleep(0.2)
        return embeddings.embed_documents(batch)

    app = create_app(embed, thread_local_counter(embeddings.tokenizer), MODEL, embeddings.dimension, limits)
    body = json.dumps({"model": MODEL, "input": texts[:20]}).encode()
    with served(app, limits) as url:
        port = int(url.split(":")[-1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            assert first.wait(10)
        time.sleep(1.0)
        settled = len(calls)
        time.sleep(1.0)
        assert len(calls) == settled <= 3, calls  # 20 one-text calls without the fix
        assert requests.post(f"{url}/embeddings", json={"model": MODEL, "input": "还在"}, timeout=10).status_code == 200


@pytest.mark.parametrize("field", ["dimensions", "input", "user"])
def test_huge_integer_anywhere_is_a_400(client, field):
    """Item 4: Python's JSON reader refuses integers over 4,300 digits with a ValueError (was a 500)."""
    body = {"model": MODEL, "input": "数据"}
    raw = json.dumps({**body, field: 0}).replace('": 0', '": ' + "9" * 5000).encode()
    response = post_raw(client, raw)
    assert response.status_code == 400 and "digits" in response.json()["error"]["message"]
    assert len(response.content) < 500


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000,
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 5_000,
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["bad-content-length", "40KB-header", "5k-headers", "bad-request-line"],
)
def test_malformed_http_is_answered_with_json(live_url, head):
    """Item 5: what h11 cannot parse never reaches the app; the protocol answers it with a JSON 400.

    Unfinished headers past h11's 16 KiB buffer are refused the same way at any size (2 MB, 20k
    lines); they stay small here so that the server reads all that was sent before it closes, and
    no TCP reset races its answer."""
    host, port = live_url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head)
        except OSError:  # the server answered and closed before reading everything
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert b"content-type: application/json" in headers.lower()
    assert "malformed HTTP request" in json.loads(body)["error"]["message"]


def test_api_description_is_not_served_with_an_api_key(embeddings):
    """Item 7: with a key, /docs, /redoc and /openapi.json are off (404); without one they are served."""
    counter = thread_local_counter(embeddings.tokenizer)
    keyed = create_app(embeddings.embed_documents, counter, MODEL, embeddings.dimension, api_key="k")
    with TestClient(keyed) as keyed_client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            response = keyed_client.get(path)
            assert response.status_code == 404 and "error" in response.json(), path
    with TestClient(create_app(embeddings.embed_documents, counter, MODEL, embeddings.dimension)) as open_client:
        assert open_client.get("/openapi.json").json()["info"]["title"] == "chatchat-policybert embeddings"
        assert open_client.get("/docs").status_code == 200


@pytest.mark.parametrize(
    "shape",
    [
        "bge",
        pytest.param("e5", marks=pytest.mark.slow),  # over 5 s (fast_loop.py)
    ],
)
def test_serve_gives_queries_the_query_prompt_and_documents_the_document_prompt(shape, request, texts):
    """``input_type: query`` (Cohere's/Voyage's field) is embedded as ``embed_query`` embeds, the default as
    ``embed_documents``: with e5's prompts (``query: `` / ``passage: ``) the two differ, and a server that embedded
    every input as a document would hand a retriever the wrong query vectors."""
    directory = request.getfixturevalue("e5_base_dir" if shape == "e5" else "tiny_model")
    embeddings = PolicyBertEmbeddings(str(directory))
    assert (embeddings.document_instruction or "") == ("passage: " if shape == "e5" else "")
    with TestClient(serving_app(embeddings, MODEL)) as client:
        documents = client.post("/v1/embeddings", json={"model": MODEL, "input": texts[:3]}).json()["data"]
        queries = client.post("/v1/embeddings", json={"model": MODEL, "input": texts[:3], "input_type": "query"})
        bad = client.post("/v1/embeddings", json={"model": MODEL, "input": texts[:1], "input_type": "passage"})
    as_documents = np.asarray([d["embedding"] for d in documents], dtype=np.float32)
    as_queries = np.asarray([d["embedding"] for d in queries.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(as_documents, embeddings.embed_documents(texts[:3]), atol=1e-6)
    np.testing.assert_allclose(as_queries, [embeddings.embed_query(t) for t in texts[:3]], atol=1e-6)
    assert np.abs(as_queries - as_documents).max() > 1e-5  # the tiny random model moves little, but it moves
    assert bad.status_code == 422 and "input_type" in bad.json()["error"]["message"]


def test_a_server_without_prompts_refuses_query_inputs(client, texts):
    """An app built on ``embed_documents`` alone cannot embed a query: it says so instead of returning a document
    vector."""
    answer = client.post("/v1/embeddings", json={"model": MODEL, "input": texts[:1], "input_type": "query"})
    assert answer.status_code == 400 and "input_type 'query' unsupported" in answer.json()["error"]["message"]

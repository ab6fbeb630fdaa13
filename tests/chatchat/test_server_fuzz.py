"""Fuzzing the embeddings server's request bodies (hypothesis): every answer is JSON with a 2xx/4xx
status, a 200 carries one unit vector per input, and the server stays up.

The app is the real one (`create_app` over the tiny PolicyBERT) in-process through the ASGI
test client; there is nothing to stand in for.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.serving.app import create_app, thread_local_counter
from chatchat_policybert.serving.limits import ServerLimits

MODEL = "policybert"
# Text with everything JSON can carry: CJK, ASCII, controls, lone surrogates, emoji.
TEXT = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x1FFFF), max_size=40) | st.sampled_from(
    ["", " ", "数据安全", "a\ud800b", "\udfff", "\x00", "\ufeff政策", "🙂" * 5]
)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
REQUEST = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "other", ""]) | JSON_VALUE,
        "input": TEXT | st.lists(TEXT, max_size=6) | JSON_VALUE,
        "encoding_format": st.sampled_from(["float", "base64", "int8"]) | JSON_VALUE,
        "dimensions": st.sampled_from([None, 32, 7, -1]) | JSON_VALUE,
        "user": JSON_VALUE,
    },
)
BODY = (
    REQUEST.map(lambda r: json.dumps(r).encode())
    | JSON_VALUE.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=200)
)
CONTENT_TYPE = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", None])


@pytest.fixture(scope="module")
def client(tiny_model):
    embeddings = PolicyBertEmbeddings(str(tiny_model))
    limits = ServerLimits(max_body_mb=4 / 1024, max_inputs=8, max_input_tokens=64, max_request_tokens=256)
    app = create_app(
        embeddings.embed_documents, thread_local_counter(embeddings.tokenizer), MODEL, embeddings.dimension, limits
    )
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODY, content_type=CONTENT_TYPE, path=st.sampled_from(["/v1/embeddings"] * 6 + ["/v1/models", "/x"]))
@example(body=b"[" * 4000, content_type="application/json", path="/v1/embeddings")
@example(
    body=b'{"model": "policybert", "input": "' + b"9" * 5000 + b'"}',
    content_type="application/json",
    path="/v1/embeddings",
)
@example(
    body=b'{"model": "policybert", "input": ["\\ud800", "ok"]}', content_type="application/json", path="/v1/embeddings"
)
def test_every_answer_is_json_2xx_or_4xx(client, body, content_type, path):
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = client.post(path, content=body, headers=headers)
    assert 200 <= response.status_code < 500, (response.status_code, response.text[:300])
    payload = response.json()
    if response.status_code == 200 and path == "/v1/embeddings":
        request = json.loads(body)
        count = 1 if isinstance(request["input"], str) else len(request["input"])
        vectors = np.asarray([d["embedding"] for d in payload["data"]], dtype=np.float32)
        assert vectors.shape[0] == count
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    else:
        assert isinstance(payload, dict) and ("error" in payload or path == "/v1/models")
    assert client.get("/health").json()["status"] == "ok"

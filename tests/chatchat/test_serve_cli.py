"""`chatchat-policybert serve` as an operator runs it: bad model directories are one line, exposure is loud."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests
from chatchat_deploy import BIN, free_port, stop_group

from chatchat_policybert.serving.limits import SHUTDOWN_GRACE_S

SERVE = [str(BIN / "chatchat-policybert"), "serve"]
pytestmark = pytest.mark.slow  # every test runs `serve` (uvicorn) in a process of its own


def test_truncated_weights_are_one_line_not_a_traceback(tiny_model, tmp_path):
    """Item 3: the loader's ModelDirError reaches the operator as `error: …`, exit 2."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = subprocess.run(
        [*SERVE, "--model-path", str(model), "--root", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr  # (the environment may print a library warning before the error)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "model.safetensors: truncated" in errors[0], result.stderr[-2000:]


def serve_until_up(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    process = subprocess.Popen(
        [*SERVE, *args, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return process, port
        except requests.RequestException:
            time.sleep(0.3)
    raise AssertionError("serve did not come up")


def test_non_loopback_without_key_warns_and_key_from_environment_is_enforced(tiny_model, tmp_path):
    """Item 7: binding every interface without a key is loud; POLICYBERT_API_KEY turns the key on."""
    process, _ = serve_until_up(["--model-path", str(tiny_model), "--root", str(tmp_path), "--host", "0.0.0.0"])
    stop_group(process, grace=5)
    warning = process.communicate()[1]
    assert "WARNING" in warning and "WITHOUT an API key" in warning and "POLICYBERT_API_KEY" in warning
    env = {**os.environ, "POLICYBERT_API_KEY": "k-123"}
    keyed, port = serve_until_up(["--model-path", str(tiny_model), "--root", str(tmp_path)], env)
    try:
        body = {"model": "policybert", "input": "数据"}
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        assert requests.post(url, json=body, timeout=30).status_code == 401
        assert requests.post(url, json=body, headers={"Authorization": "Bearer k-123"}, timeout=30).status_code == 200
    finally:
        stop_group(keyed, grace=5)
    assert "WARNING" not in keyed.communicate()[1]


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_unfinished_headers_and_silent_connections_are_closed(tiny_model, tmp_path):
    """Item 7: a client that never finishes its headers, or sends nothing, is answered 408 and cut off
    after --read-timeout, while other clients are served."""
    process, port = serve_until_up(["--model-path", str(tiny_model), "--root", str(tmp_path), "--read-timeout", "1"])
    try:
        start = time.monotonic()
        unfinished = socket.create_connection(("127.0.0.1", port), timeout=10)
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        unfinished.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
        body = {"model": "policybert", "input": "数据"}
        assert requests.post(f"http://127.0.0.1:{port}/v1/embeddings", json=body, timeout=30).status_code == 200
        for sock in (unfinished, silent):
            with sock:
                answer = read_to_close(sock)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"request headers not received within 1 s" in answer, answer
        assert time.monotonic() - start < 10  # a bound on behaviour (closed at all), not a speed measurement
    finally:
        stop_group(process, grace=5)


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--max-body-mb", "inf", "max_body_mb"),
        ("--port", "99999", "--port 99999"),
        ("--max-wait-ms", "inf", "max_wait_ms"),
        ("--max-wait-ms", "5000", "max_wait_ms must be at most"),
        ("--read-timeout", "nan", "read_timeout"),
    ],
)
def test_impossible_serve_flags_are_one_error_line(tiny_model, tmp_path, flag, value, fragment):
    """Issue #23 item 6: values that overflowed (OverflowError tracebacks) or hung every request are refused."""
    result = subprocess.run(
        [*SERVE, "--model-path", str(tiny_model), "--root", str(tmp_path), flag, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], result.stderr[-2000:]


def test_sigterm_stops_the_server_with_a_request_in_flight(tiny_model, tmp_path):
    """Issue #23 item 6: SIGTERM waits at most SHUTDOWN_GRACE_S for running requests (here: a body
    that never finishes, which --read-timeout 60 would otherwise wait a minute for)."""
    process, port = serve_until_up(["--model-path", str(tiny_model), "--root", str(tmp_path), "--read-timeout", "60"])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
            stalled.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            time.sleep(0.5)
            start = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=SHUTDOWN_GRACE_S + 15)
        assert time.monotonic() - start < SHUTDOWN_GRACE_S + 15
    finally:
        stop_group(process, grace=5)


def one_error(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a refused command (exit 2, no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    return error


def test_a_model_path_that_is_not_there_is_one_error_line(tmp_path):
    """#43 item 9: ``serve --model-path /nonexistent`` was a 19-line traceback (FileNotFoundError)."""
    missing = tmp_path / "nonexistent"
    result = subprocess.run(
        [*SERVE, "--model-path", str(missing), "--root", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert one_error(result) == f"error: --model-path {missing}: not a directory; expected a PolicyBERT model directory"


@pytest.mark.parametrize("case", ["port in use", "host 999.1.1.1"])
def test_a_port_in_use_or_a_host_that_is_no_address_is_refused_before_the_model_loads(tiny_model, tmp_path, case):
    """#43 item 9: serve loaded the model, printed "serving … at", then exited 3. Now one error line naming the flag,
    checked first: the model directory here is not even a model (an empty folder), and the flag is what is named."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        host = "127.0.0.1" if case == "port in use" else "999.1.1.1"
        result = subprocess.run(
            [*SERVE, "--model-path", str(empty), "--root", str(tmp_path), "--host", host, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    error = one_error(result)
    assert "serving" not in result.stdout, result.stdout
    if case == "port in use":
        assert error.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there"), error
        assert "another process listens there" in error, error
    else:
        assert error.startswith("error: --host '999.1.1.1': expected an IP address of this machine"), error

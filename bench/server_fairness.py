"""Latency of a 1-text request while another client streams maximal requests at `chatchat-policybert serve`.

    python bench/server_fairness.py                       # bge-base-sized random PolicyBERT (attn), CPU
    python bench/server_fairness.py --size tiny --seconds 20 --json bench/results/server_fairness.json

Issue #15 item 2's target: p95 <= 1 s for the small request under that load. The server runs
as an operator starts it (`chatchat-policybert serve --model-path DIR`, a subprocess); a "heavy"
client thread sends back-to-back requests as large as the limits allow (`--max-request-tokens`
worth of `--chars`-character inputs), and a "light" client sends one short sentence at a time.
Each scheduler setting is measured in the same run: first idle (light client alone), then under
load with the shipped turn-taking (`--batch-tokens`, one forward pass per turn), then under load
with turn-taking switched off (a whole request per model call, as before issue #15). Models have
random weights: latency does not depend on the values, and these are not bge numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import REPO, build_models, corpus_chunks, machine_line

sys.path.insert(0, str(REPO))
from chatchat_policybert.data import LEXICON
from chatchat_policybert.model.lexicon import Lexicon
from tests.support.tiny_models import build_tiny_policybert

SERVE = [str(Path(sys.executable).parent / "chatchat-policybert"), "serve"]
TARGET_P95_S = 1.0
LIGHT_TEXT = "数据要素市场化配置改革的主要任务是什么？"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, device: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [*SERVE, "--model-path", str(model), "--device", device, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"serve exited: {process.stderr.read()[-2000:]}")
        try:
            if requests.get(url + "/health", timeout=2).ok:
                return process, url
        except requests.RequestException:
            time.sleep(0.5)
    raise SystemExit("serve did not come up within 300 s")


def light_latencies(url: str, seconds: float) -> list[float]:
    """Seconds per 1-text request, one after another, for ``seconds``."""
    latencies, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        response = requests.post(url + "/v1/embeddings", json={"model": "policybert", "input": LIGHT_TEXT}, timeout=600)
        response.raise_for_status()
        latencies.append(time.perf_counter() - start)
    return latencies


def heavy_client(url: str, inputs: list[str], stop: threading.Event, done: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        requests.post(
            url + "/v1/embeddings", json={"model": "policybert", "input": inputs}, timeout=3600
        ).raise_for_status()
        done.append(time.perf_counter() - start)


def summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "p50_s": round(statistics.median(ordered), 4),
        "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
        "max_s": round(ordered[-1], 4),
    }


def measure(model: Path, args: argparse.Namespace, inputs: list[str], scheduler: list[str], loaded: bool) -> dict:
    process, url = start_server(model, args.device, ["--max-request-tokens", str(args.max_request_tokens), *scheduler])
    try:
        light_latencies(url, 2.0)  # warm-up
        stop, heavy_times = threading.Event(), []
        heavy = threading.Thread(target=heavy_client, args=(url, inputs, stop, heavy_times), daemon=True)
        if loaded:
            heavy.start()
            time.sleep(1.0)  # the first large request is in the model
        result = summary(light_latencies(url, args.seconds))
        stop.set()
        if loaded:
            heavy.join(3600)
            result["heavy_requests_done"] = len(heavy_times)
            result["heavy_request_s"] = round(statistics.median(heavy_times), 2) if heavy_times else None
        return result
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", choices=("base", "tiny"), default="base", help="bge-base-sized or the tests' tiny model"
    )
    parser.add_argument("--model", type=Path, help="serve this model directory instead of building one")
    parser.add_argument("--device", default="cpu", help="torch device the served model runs on")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the light client measures per setting")
    parser.add_argument("--chars", type=int, default=500, help="characters per input of the heavy client's requests")
    parser.add_argument(
        "--max-request-tokens", type=int, default=300_000, help="the server's cap, and the heavy request size"
    )
    parser.add_argument(
        "--batch-tokens", type=int, default=4096, help="the server's turn size in tokens (serve --batch-tokens)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    count = min(2048, args.max_request_tokens // (args.chars + 2))
    inputs = corpus_chunks(args.chars, count)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            model = args.model
        elif args.size == "tiny":
            model = build_tiny_policybert(Path(tmp) / "tiny", inputs + [LIGHT_TEXT], Lexicon.load(LEXICON), "attn")
        else:
            model = build_models(Path(tmp), inputs + [LIGHT_TEXT], names=("attn",))["attn"]
        settings = {
            "idle": ([], False),
            f"loaded, turns of {args.batch_tokens} tokens (shipped)": (
                ["--batch-tokens", str(args.batch_tokens)],
                True,
            ),
            "loaded, a whole request per model call (before #15)": (
                ["--batch-tokens", str(10**9), "--max-batch", str(10**6)],
                True,
            ),
        }
        results = {name: measure(model, args, inputs, flags, loaded) for name, (flags, loaded) in settings.items()}
    report = {
        "machine": machine_line(args.device, torch.get_num_threads()),
        "command": "python " + " ".join(sys.argv),
        "model": str(args.model or f"random {args.size} PolicyBERT (attn)"),
        "heavy_request": f"{count} inputs x {args.chars} characters",
        "target_p95_s": TARGET_P95_S,
        "results": results,
    }
    print(json.dumps(report, indent=2, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

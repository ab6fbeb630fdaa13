"""A real Chatchat 0.3.1.3 deployment in a temporary CHATCHAT_ROOT, built once per session.

`chatchat init` → `chatchat-policybert setup` with a tiny PolicyBERT → a few shared-corpus
policies in WeiMingPolicies → `chatchat kb -r`. The only stand-in is Ollama, replaced at the
network boundary by a loopback OpenAI-compatible server.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from chatchat_deploy import (
    BIN,
    MAX_DOC_CHARS,
    N_DOCUMENTS,
    Deployment,
    free_port,
    run,
    stop_group,
    wait_until,
)
from ollama_standin import OllamaStandIn

from chatchat_policybert.chatchat.process import chatchat_env
from chatchat_policybert.corpus import PolicyDocument, read_policies
from chatchat_policybert.errors import InputError
from tests.support.fast_loop import slow_fixture
from tests.support.pg_cluster import PgCluster


@pytest.fixture(scope="session")
def policies(data_dir: Path) -> list[PolicyDocument]:
    documents = read_policies(data_dir / "policy_corpus" / "Policys_cleaned.csv")[:N_DOCUMENTS]
    return [PolicyDocument(d.title, d.pubtime, d.channel, d.content[:MAX_DOC_CHARS]) for d in documents]


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> Path:
    """The shared tiny PolicyBERT (attention fusion, reference lexicon)."""
    return tiny_model_dir("attn")


@pytest.fixture(scope="session")
def standin():
    server = OllamaStandIn().start()
    yield server
    server.stop()


@slow_fixture(scope="session")
def deployment(tmp_path_factory, tiny_model: Path, standin: OllamaStandIn) -> Deployment:
    """The README's main job (`python -m chatchat_policybert.demo`) on a few short policies."""
    root = tmp_path_factory.mktemp("chatchat_root")
    env = chatchat_env(root)
    demo = run(
        [
            str(BIN / "python"),
            "-m",
            "chatchat_policybert.demo",
            "--root",
            str(root),
            "--model",
            str(tiny_model),
            "--docs",
            str(N_DOCUMENTS),
            "--max-doc-chars",
            str(MAX_DOC_CHARS),
            "--ollama-url",
            standin.url,
        ],
        env,
    )
    deployment = Deployment(
        root, tiny_model, env, free_port(), free_port(), standin, demo_log=demo.stdout + demo.stderr
    )
    assert demo.returncode == 0, deployment.demo_log[-5000:]
    # Chatchat exits 0 even when embedding fails: judge by the index.
    assert (deployment.vector_store / "index.faiss").is_file(), deployment.demo_log[-5000:]

    basic_path = root / "basic_settings.yaml"
    basic = yaml.safe_load(basic_path.read_text(encoding="utf-8"))
    port, webui = deployment.api_port, deployment.webui_port
    basic["API_SERVER"] = {"host": "127.0.0.1", "port": port, "public_host": "127.0.0.1", "public_port": port}
    basic["WEBUI_SERVER"] = {"host": "127.0.0.1", "port": webui}
    basic_path.write_text(yaml.safe_dump(basic, allow_unicode=True), encoding="utf-8")
    return deployment


@pytest.fixture(scope="session")
def server(deployment: Deployment):
    """`chatchat start -a` (API + WebUI) on loopback; every process of its group is stopped after."""
    log_path = deployment.root / "start.log"
    log = log_path.open("w", encoding="utf-8")
    process = subprocess.Popen(
        [str(BIN / "chatchat"), "start", "-a"],
        env=deployment.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: requests.get(f"{deployment.api}/knowledge_base/list_knowledge_bases", timeout=2).ok,
            process,
            log_path,
            "API server",
        )
        wait_until(
            lambda: requests.get(f"http://127.0.0.1:{deployment.webui_port}/_stcore/health", timeout=2).ok,
            process,
            log_path,
            "WebUI",
        )
        yield deployment, log_path
    finally:
        stop_group(process)
        log.close()


@slow_fixture(scope="module")
def cluster() -> Iterator[PgCluster]:
    """A throw-away PostgreSQL + pgvector server for the module's `pg` tests (test_pg.py, test_query_tune.py)."""
    try:
        server = PgCluster.start()
    except InputError as exc:
        if os.environ.get("CI"):  # .ci/run installs them: in CI a missing server is a failure, not a skip
            pytest.fail(str(exc))
        pytest.skip(f"no PostgreSQL + pgvector here ({exc})")
    yield server
    server.stop()

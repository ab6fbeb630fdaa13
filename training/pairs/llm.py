"""Questions written per chunk by an OpenAI-compatible chat endpoint (by default the deployment's Ollama), cached."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

from chatchat_policybert.errors import InputError
from chatchat_policybert.evaluation.knowledge_base import Chunk
from training.pairs.queries import Pair

PROMPT_VERSION = 1
PROMPT = (
    "下面是一段政策文件的内容。请以普通市民或政府工作人员的口吻，"
    "提出{n}个能够用这段内容回答的问题。问题要具体、自然，像真实用户会在政务问答系统里输入的那样；"
    "每行一个问题，不要编号，不要回答。\n\n{chunk}"
)

LIST_MARK = re.compile(r"^\s*(?:[-*•·]|\d+\s*[.、)）:：]|[（(]\d+[)）]|问题?\s*\d*\s*[:：])\s*")


def parse_questions(reply: str, limit: int) -> list[str]:
    """Question lines of a chat reply, list marks and quotes removed."""
    questions = []
    for line in reply.splitlines():
        question = LIST_MARK.sub("", line).strip().strip("\"'“”「」*")
        if len(question) >= 5 and question not in questions:
            questions.append(question)
    return questions[:limit]


def chat(url: str, model: str, content: str, timeout: float, temperature: float, flag: str = "--llm") -> str:
    """The reply of an OpenAI-compatible ``/chat/completions`` at ``url`` to one user message; where the server does
    not answer, answers an error, or not as OpenAI does, one :class:`InputError` line naming ``flag``."""
    url = url.rstrip("/")
    body = {
        "model": model,
        "stream": False,
        "temperature": temperature,
        "messages": [{"role": "user", "content": content}],
    }
    request = urllib.request.Request(
        f"{url}/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())["choices"][0]["message"]["content"] or ""
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        raise InputError(
            f"{flag} {url}: HTTP {exc.code} for model {model!r}: {detail} (the URL should end in /v1, and the model "
            f"be pulled: `ollama pull {model}`)"
        ) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InputError(
            f"{flag} {url}: the chat endpoint is not answering ({reason}); start it (`ollama serve`) or pass the URL "
            "of a running OpenAI-compatible server"
        ) from None
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        raise InputError(f"{flag} {url}: the reply is not an OpenAI chat completion") from None


class ReplyCache:
    """The chat endpoint's answers, one JSON line each (``{"key", "value"}``), appended and flushed as they arrive: an
    interruption loses at most the answer in flight, and the next run asks only for what the file lacks. A line an
    interruption cut short is skipped when read (asked again), and never swallows the next one written."""

    def __init__(self, path: Path, field: str = "value"):
        self.path, self.field = path, field
        self.known: dict[str, Any] = {}
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.known[entry["key"]] = entry[field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def __contains__(self, key: str) -> bool:
        return key in self.known

    def __getitem__(self, key: str) -> Any:
        return self.known[key]

    def add(self, key: str, value: Any) -> None:
        self.known[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+", encoding="utf-8") as handle:
            handle.seek(0, 2)
            if handle.tell():  # a cut-short last line must not swallow this entry
                handle.seek(handle.tell() - 1)
                if handle.read(1) != "\n":
                    handle.write("\n")
            handle.write(json.dumps({"key": key, self.field: value}, ensure_ascii=False) + "\n")


class LlmQuestions:
    """Questions per chunk from an OpenAI-compatible ``/chat/completions``, cached line by line in ``cache`` (a
    :class:`ReplyCache`, keyed by model, prompt and text)."""

    def __init__(self, url: str, model: str, questions: int, timeout: float, cache: Path):
        self.url, self.model, self.questions, self.timeout = url.rstrip("/"), model, questions, timeout
        self.cache = ReplyCache(cache, "questions")

    def key(self, text: str) -> str:
        return hashlib.sha1(f"{PROMPT_VERSION}\n{self.model}\n{self.questions}\n{text}".encode()).hexdigest()

    def ask(self, text: str) -> list[str]:
        content = PROMPT.format(n=self.questions, chunk=text)
        return parse_questions(chat(self.url, self.model, content, self.timeout, 0.7) or "", self.questions)

    def pairs(self, chunks: list[Chunk], indices: list[int]) -> list[Pair]:
        todo = [i for i in indices if self.key(chunks[i].text) not in self.cache]
        for i in tqdm(todo, desc=f"questions ({self.model})", unit="chunk"):
            self.cache.add(self.key(chunks[i].text), self.ask(chunks[i].text))
        return [Pair("llm", q, chunks[i].text, i) for i in indices for q in self.cache[self.key(chunks[i].text)]]

"""Questions written per chunk by an OpenAI-compatible chat endpoint (by default the deployment's Ollama), cached."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

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


class LlmQuestions:
    """Questions per chunk from an OpenAI-compatible ``/chat/completions``, cached line by line in ``cache``.

    Each answer is appended and flushed as it arrives: an interruption loses at most the chunk in
    flight, and the next run asks only for chunks the cache lacks (keyed by model, prompt and text).
    """

    def __init__(self, url: str, model: str, questions: int, timeout: float, cache: Path):
        self.url, self.model, self.questions, self.timeout, self.cache = (
            url.rstrip("/"),
            model,
            questions,
            timeout,
            cache,
        )
        self.known: dict[str, list[str]] = {}
        if cache.is_file():
            for line in cache.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.known[entry["key"]] = list(entry["questions"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # the line an interruption cut short; its chunk is asked again

    def key(self, text: str) -> str:
        return hashlib.sha1(f"{PROMPT_VERSION}\n{self.model}\n{self.questions}\n{text}".encode()).hexdigest()

    def ask(self, text: str) -> list[str]:
        content = PROMPT.format(n=self.questions, chunk=text)
        return parse_questions(chat(self.url, self.model, content, self.timeout, 0.7) or "", self.questions)

    def pairs(self, chunks: list[Chunk], indices: list[int]) -> list[Pair]:
        todo = [i for i in indices if self.key(chunks[i].text) not in self.known]
        if todo:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            with self.cache.open("a+", encoding="utf-8") as handle:
                handle.seek(0, 2)
                if handle.tell():  # a cut-short last line must not swallow the next entry
                    handle.seek(handle.tell() - 1)
                    if handle.read(1) != "\n":
                        handle.write("\n")
                for i in tqdm(todo, desc=f"questions ({self.model})", unit="chunk"):
                    key = self.key(chunks[i].text)
                    self.known[key] = self.ask(chunks[i].text)
                    handle.write(json.dumps({"key": key, "questions": self.known[key]}, ensure_ascii=False) + "\n")
                    handle.flush()
        return [Pair("llm", q, chunks[i].text, i) for i in indices for q in self.known[self.key(chunks[i].text)]]

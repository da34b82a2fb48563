"""Built-in `search`: BM25 (the `bm25s` library) over a local corpus, for retrieval-augmented episodes.

The default corpus is `search_corpus.json` shipped in this package (60 short encyclopedic passages written for
the project: Sokoban, RL, Python, arithmetic, science, geography). Point `make_search_tool(path)` or the
AGENTRL_SEARCH_CORPUS variable at a JSON list or a JSONL file of {"title", "text"} records to use your own.
The index is built once, on first use, and shared by all calls.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from agentrl.tools.core import Tool

DEFAULT_CORPUS = Path(__file__).with_name("search_corpus.json")


def load_corpus(path: str | Path) -> list[dict[str, Any]]:
    """A JSON list or JSONL file of records with "text" (and optionally "title")."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        docs = json.loads(text)
    else:
        docs = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not docs or not all(isinstance(d, dict) and isinstance(d.get("text"), str) for d in docs):
        raise ValueError(f"{path}: expected a non-empty list of {{'title', 'text'}} records")
    return docs


class BM25Index:
    """Lazily built BM25 index (thread-safe build; retrieval is read-only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._retriever: Any = None
        self.docs: list[dict[str, Any]] = []

    def _build(self) -> Any:
        import bm25s  # imported on first search: it pulls in numpy/scipy

        with self._lock:
            if self._retriever is None:
                self.docs = load_corpus(self.path)
                texts = [f"{d.get('title', '')}. {d['text']}" for d in self.docs]
                retriever = bm25s.BM25()
                retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
                self._retriever = retriever
        return self._retriever

    def search(self, query: str, k: int = 3) -> list[tuple[dict[str, Any], float]]:
        import bm25s

        retriever = self._retriever or self._build()
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        known = [t for t in tokens if t in retriever.vocab_dict]
        if not known:
            return []
        k = max(1, min(k, len(self.docs)))
        ids, scores = retriever.retrieve([known], k=k, show_progress=False, n_threads=1)
        return [(self.docs[int(i)], float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


def make_search_tool(corpus: str | Path | None = None, name: str = "search") -> Tool:
    """A search tool over `corpus` (default: AGENTRL_SEARCH_CORPUS or the shipped corpus)."""
    index = BM25Index(corpus or os.environ.get("AGENTRL_SEARCH_CORPUS") or DEFAULT_CORPUS)

    def search(
        query: Annotated[str, Field(min_length=1, max_length=1000)],
        k: Annotated[int, Field(ge=1, le=10)] = 3,
    ) -> str:
        """Search a local encyclopedia and return the most relevant passages, best first.

        Args:
            query: keywords or a question, e.g. "capital of Japan".
            k: how many passages to return (1-10).
        """
        hits = index.search(query, k)
        if not hits:
            return "No results."
        return "\n\n".join(f"[{n}] {d.get('title', '')}: {d['text']}" for n, (d, _) in enumerate(hits, 1))

    return Tool(search, name=name)


search = make_search_tool()

"""Talking to a running OpenAI-compatible engine: is it serving our target, and what its /metrics count."""
from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from eagle3.engine.state import ServerError
from eagle3.target.chat import render

METRIC = re.compile(r'^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total)'
                    r'\{([^}]*)\}\s+([0-9.eE+-]+)$')


def same_model(served: str, expected: str) -> bool:
    if Path(served).exists() and Path(expected).exists():
        return Path(served).resolve() == Path(expected).resolve()
    return served == expected


def check_served_model(url: str, entry: dict[str, Any], record: dict[str, Any], tokenizer: Any) -> None:
    """Refuse a server whose weights or chat template differ from artifacts/target."""
    served = entry.get("root") or entry["id"]
    if not same_model(served, record["model_path"]):
        raise ServerError(f"server at {url} serves {served!r}, but artifacts/target is {record['model_path']!r}")
    probe = [{"role": "user", "content": "Tokenizer check: 1 + 1 = 2, naïve café."}]
    response = httpx.post(f"{url}/tokenize", json={"model": entry["id"], "messages": probe,
                                                   "add_generation_prompt": True}, timeout=30)
    if response.status_code == 404:
        print(f"{url} has no /tokenize; relying on the per-request prompt id check", file=sys.stderr)
    elif response.status_code != 200:  # an error is not an answer about the template
        raise ServerError(f"server at {url}: /tokenize answered {response.status_code} ({response.text[:200]!r}), "
                          "so its chat template cannot be checked against artifacts/target")
    elif response.json().get("tokens") != render(tokenizer, probe, generation_prompt=True):
        raise ServerError(f"server at {url} renders prompts with another tokenizer or chat template than "
                          f"artifacts/target ({record['model_path']})")


def scrape(url: str) -> dict[str, float]:
    return parse_spec_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def parse_spec_metrics(text: str) -> dict[str, float]:
    """Spec-decode counters of a Prometheus page, summed over engines; per position keyed 'pos<i>'."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = METRIC.match(line)
        if match:
            name, labels, value = match.groups()
            position = re.search(r'position="(\d+)"', labels)
            totals[f"pos{position.group(1)}" if position else name.split("num_")[1].removesuffix("_total")] += float(value)
    return totals


def generation_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))

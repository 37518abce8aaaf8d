"""The target's chat template: the one rendering of messages into token ids every stage uses."""
from __future__ import annotations

from typing import Any


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """Token ids of messages through the target's chat template (the one rendering every stage uses)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=True)["input_ids"])


def template_matches(tokenizer: Any, context: list[dict], content: str, reasoning: str | None, ids: list[int]) -> bool:
    """Re-rendering reasoning + content must reproduce the stored ids (the stored ids stay the truth)."""
    answer = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
    rendered = render(tokenizer, context + [answer], generation_prompt=False)
    return rendered[: len(ids)] == ids

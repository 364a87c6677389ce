"""Renders a GGUF's own chat template (``tokenizer.chat_template``) with Jinja2.

llama.cpp's built-in ``llama_chat_apply_template`` recognises only templates it knows
by heuristics; rendering the real Jinja text is what transformers does and is exact.
"""
from __future__ import annotations

from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import HeteroSpecError


class TemplateRenderError(HeteroSpecError):
    pass


# The documented fallback for models without a template (base models such as Gemma 3 270M
# pretrained): plain "User: ...\n\nAssistant: ..." turns, BOS first, each answer closed by EOS, so
# a loss mask still covers the answer through EOS and generation stops there or at its token
# limit.  Chosen explicitly (``--template plain``), never guessed.  An answer is rendered as
# " " + content after "Assistant:", because SentencePiece and BPE vocabularies put the space in the
# answer's first token, which is what a model continues "Assistant:" with.
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}Assistant: {{ m['content'] }}{{ eos_token }}\n\n"
    "{% elif m['role'] == 'system' %}System: {{ m['content'] }}\n\n"
    "{% else %}User: {{ m['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def plain_prompt(messages: list[dict[str, str]]) -> str:
    r"""``messages`` as the plain template renders them, without BOS: the text for a raw prompt
    (``hetero-spec run --raw``, ``HeteroSpec.generate``), which adds the model's BOS when tokenizing.

    >>> plain_prompt([{"role": "user", "content": "Name three primes."}])
    'User: Name three primes.\n\nAssistant:'
    """
    return render_chat(PLAIN_TEMPLATE, messages)


def _raise(message: str) -> None:
    raise TemplateRenderError(f"chat template refused the conversation: {message}")


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    template: str | None,
    messages: list[dict[str, str]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """messages: [{"role": "user", "content": "..."}, ...] -> the prompt text, special tokens as text."""
    if not template:
        raise TemplateRenderError("the model has no chat template (tokenizer.chat_template); use a plain prompt "
                                  "(hetero-spec run --raw, HeteroSpec.generate)")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise TemplateRenderError(f"each message needs 'role' and 'content', got {m!r}")
    try:
        return _compile(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError as exc:
        raise TemplateRenderError(f"chat template failed to render: {exc}") from None

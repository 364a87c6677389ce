"""Pydantic models of the OpenAI request bodies this server accepts.

Strict: a number sent as a string, an unknown role or an empty ``messages`` list is a 400 with
the field named, rather than a guess.  Fields the API defines but this server does not use
(``user``, ``presence_penalty``...) are ignored, as llama.cpp's and llama-cpp-python's servers
do.  Omitted sampling fields take llama.cpp's defaults (temperature 0.8, top-p 0.95, top-k 40,
min-p 0.05); ``temperature: 0`` is greedy and equals ``hetero-spec run``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config import SamplingConfig
from ..inputs import stop_strings

MAX_STOP = 4  # the OpenAI API's limit


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn; ``developer`` is OpenAI's newer name for ``system``; text parts are joined."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class GenerationFields(BaseModel):
    """What chat and text completions share: model, length, sampling, stop strings, streaming."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.8, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(0.95, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = 40  # llama.cpp extension; <= 0: off
    min_p: float = Field(0.05, ge=0.0, lt=1.0, allow_inf_nan=False)  # llama.cpp extension
    seed: int | None = Field(None, ge=-1)  # None or -1: a fresh seed per request
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None  # chat: a bool; completions: how many
    top_logprobs: int | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value:  # refused rather than answered with null: a client that asks for them needs them
            raise ValueError("log probabilities are not returned by this server")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (one model instance decodes one sequence at a time)")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop)

    def sampling(self, fresh_seed: int) -> SamplingConfig:
        """top_p 0 means "only the most likely token": greedy, as the OpenAI API treats it."""
        temperature = 0.0 if self.top_p == 0.0 else self.temperature
        seed = fresh_seed if self.seed is None or self.seed < 0 else self.seed
        return SamplingConfig(temperature=temperature, top_k=self.top_k, top_p=self.top_p or 1.0, min_p=self.min_p,
                              seed=seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name; wins over max_tokens

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

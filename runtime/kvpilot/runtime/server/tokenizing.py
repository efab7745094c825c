"""Prompt text -> token ids as the generation endpoints do it, and vLLM's /tokenize, /detokenize.

`chat_prompt_ids` is the one place a conversation becomes token ids, so /tokenize's `count` for
some messages is exactly the `prompt_tokens` a chat completion of them reports.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from kvpilot.runtime.models.tokenizer_files import Tokenizer
from kvpilot.runtime.server.chat_template import ChatTemplateError, render_chat
from kvpilot.runtime.server.errors import ApiError
from kvpilot.runtime.server.input_limits import check_num_chars
from kvpilot.runtime.server.request_models import ChatMessage, DetokenizeRequest, TokenizeRequest
from kvpilot.runtime.server.response_models import DetokenizeResponse, TokenizeResponse


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them: text parts joined into one string, as HF does."""
    result = []
    for message in messages:
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            data["content"] = message.text()
        for call in data.get("tool_calls") or []:
            _arguments_as_object(call)
        result.append(data)
    return result


def _arguments_as_object(call: Any) -> None:
    """Templates write an assistant tool call's arguments with `| tojson` (Qwen, Llama 3.1), so
    they get the object, as vLLM gives them; arguments that are not JSON stay text."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(function["arguments"])


def text_prompt_ids(
    tok: Tokenizer, prompt: str, max_model_len: int, add_special_tokens: bool = True
) -> list[int]:
    """A completion prompt's token ids; text that cannot fit is refused before tokenising."""
    check_num_chars(len(prompt), "prompt", max_model_len, tok.max_chars_per_token)
    return tok.encode(prompt, add_special_tokens)


def chat_prompt_ids(
    tok: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    max_model_len: int,
    add_special_tokens: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The rendered chat template's token ids, with exactly one BOS when specials are added.

    The messages' text alone is checked against the context before rendering: the template only
    adds to it, so text that cannot fit is refused before spending time on it.
    """
    num_chars = sum(len(message.text() or "") for message in messages)
    check_num_chars(num_chars, "messages", max_model_len, tok.max_chars_per_token)
    try:
        text = render_chat(
            tok.chat_template,
            message_dicts(messages),
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}),  # as transformers: only when there are any
        )
    except ChatTemplateError as exc:
        raise ApiError(400, f"messages: {exc}", "messages") from exc
    ids = tok.encode(text, add_special_tokens)
    if tok.bos_token and text.startswith(tok.bos_token) and ids[1:2] == ids[:1]:
        ids = ids[1:]  # the template wrote BOS and the encoder added one: keep exactly one
    return ids


def tokenize(tok: Tokenizer, body: TokenizeRequest, max_model_len: int) -> TokenizeResponse:
    specials = body.add_special_tokens
    if body.messages is not None:
        ids = chat_prompt_ids(
            tok, body.messages, body.add_generation_prompt, max_model_len, specials
        )
    else:
        ids = text_prompt_ids(tok, body.prompt or "", max_model_len, specials)
    strs = tok.token_strs(ids) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(tok: Tokenizer, body: DetokenizeRequest) -> DetokenizeResponse:
    check_in_vocab(tok.vocab_size, body.tokens, "tokens")
    # special tokens are kept, so detokenize(tokenize(text)) shows what the model reads
    return DetokenizeResponse(prompt=tok.decode(body.tokens, skip_special_tokens=False))


def check_in_vocab(vocab_size: int, ids: list[int] | tuple[int, ...], field: str) -> None:
    outside = [token_id for token_id in ids if token_id >= vocab_size]
    if outside:
        raise ApiError(
            400,
            f"{field}: token id {outside[0]} is outside the vocabulary "
            f"(ids are 0..{vocab_size - 1})",
            field,
        )

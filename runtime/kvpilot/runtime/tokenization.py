"""Prompt text -> token ids as the generation endpoints do it, and vLLM's /tokenize, /detokenize.

`chat_prompt_ids` is the one place a conversation becomes token ids, so /tokenize's `count` for
some messages is exactly the `prompt_tokens` a chat completion of them reports.
"""

from __future__ import annotations

from typing import Any

from kvpilot.runtime.api_errors import ApiError
from kvpilot.runtime.chat import ChatTemplateError, render_chat
from kvpilot.runtime.protocol import (
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvpilot.runtime.tokenizer import Tokenizer


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them: text parts joined into one string, as HF does."""
    result = []
    for message in messages:
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            data["content"] = message.text()
        result.append(data)
    return result


def chat_prompt_ids(
    tok: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    add_special_tokens: bool = True,
) -> list[int]:
    """The rendered chat template's token ids, with exactly one BOS when specials are added."""
    try:
        text = render_chat(
            tok.chat_template,
            message_dicts(messages),
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, f"messages: {exc}", "messages") from exc
    ids = tok.encode(text, add_special_tokens)
    if tok.bos_token and text.startswith(tok.bos_token) and ids[1:2] == ids[:1]:
        ids = ids[1:]  # the template wrote BOS and the encoder added one: keep exactly one
    return ids


def tokenize(tok: Tokenizer, body: TokenizeRequest, max_model_len: int) -> TokenizeResponse:
    if body.messages is not None:
        ids = chat_prompt_ids(
            tok, body.messages, body.add_generation_prompt, body.add_special_tokens
        )
    else:
        ids = tok.encode(body.prompt or "", body.add_special_tokens)
    strs = tok.token_strs(ids) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(tok: Tokenizer, body: DetokenizeRequest) -> DetokenizeResponse:
    check_in_vocab(tok, body.tokens, "tokens")
    # special tokens are kept, so detokenize(tokenize(text)) shows what the model reads
    return DetokenizeResponse(prompt=tok.decode(body.tokens, skip_special_tokens=False))


def check_in_vocab(tok: Tokenizer, ids: list[int] | tuple[int, ...], field: str) -> None:
    vocab = tok.vocab_size
    outside = [token_id for token_id in ids if token_id >= vocab]
    if outside:
        raise ApiError(
            400,
            f"{field}: token id {outside[0]} is outside the vocabulary (ids are 0..{vocab - 1})",
            field,
        )

"""A checkpoint's tokenizer files: tokenizer.json, tokenizer_config.json, generation_config.json."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from kvpilot.runtime.models.loader import read_json


def _token_text(value: Any) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts with a `content` key."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(config: dict[str, Any], model_dir: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja = model_dir / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    return template


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"missing tokenizer.json in {model_dir}")
        self.hf = HFTokenizer.from_file(str(path))
        config = read_json(model_dir / "tokenizer_config.json")
        self.chat_template: str | None = _chat_template(config, model_dir)
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.eos_token_ids: list[int] = self._eos_ids(model_dir)

    def _eos_ids(self, model_dir: Path) -> list[int]:
        ids: list[int] = []
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            eos = read_json(gen_path).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.eos_token and (token_id := self.hf.token_to_id(self.eos_token)) is not None:
            ids.append(token_id)
        return list(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids with the checkpoint's own special-token rules (e.g. a leading BOS).

        Through `encode_batch`, which releases the GIL while it works (`encode` holds it), so a
        long prompt tokenised in the server's thread pool does not stall the event loop.
        """
        batch = self.hf.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def decode_stream(self) -> TokenStream:
        """A detokeniser fed one token at a time, whose pieces join into what `decode` gives
        (special tokens skipped)."""
        return TokenStream(self.hf)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry as stored (e.g. 'Ġthe' for byte-level BPE)."""
        return [self.hf.id_to_token(token_id) or "" for token_id in token_ids]

    @cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for, from the vocabulary.

        A vocabulary entry is never shorter than the text it encodes: byte-level BPE stores one
        character per byte (and a character is at least one byte), SentencePiece stores the text
        with spaces as '▁', and added tokens are their own text. So a text of N characters needs
        at least N / max_chars_per_token tokens, which lets the server refuse an oversized prompt
        before spending time to tokenise it.
        """
        vocab = self.hf.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)


class TokenStream:
    """tokenizers' DecodeStream bound to its tokenizer: the text each new token completes."""

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self.stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str | None:
        piece = self.stream.step(self.hf, token_id)
        return None if piece is None else str(piece)

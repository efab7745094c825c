"""A checkpoint's tokenizer files: tokenizer.json, tokenizer_config.json, generation_config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kvpilot.runtime.loader import read_json


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

    def encode(self, text: str) -> list[int]:
        """Token ids with the checkpoint's own special-token rules (e.g. a leading BOS)."""
        return list(self.hf.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=True))

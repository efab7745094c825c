"""chat.render_chat renders exactly what transformers' apply_chat_template renders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvpilot.runtime.server.chat_template import ChatTemplateError, render_chat

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"

TEMPLATES = {
    # the tiny model's style: no BOS in the template
    "tiny": (
        "{% for message in messages %}"
        "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    # Llama-2 style: bos/eos tokens, raise_exception, trim_blocks/lstrip_blocks whitespace
    "llama2": """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}{% set rest = messages[1:] %}
{% else %}
    {% set system = false %}{% set rest = messages %}
{% endif %}
{% for message in rest %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant') }}
    {% endif %}
    {% if loop.index0 == 0 and system %}
        {{ bos_token + '[INST] <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}
        {{- message['content'] + ' [/INST]' }}
    {% elif message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] + ' ' + eos_token }}
    {% endif %}
{% endfor %}""",
    # ChatML with tojson (must not HTML-escape), loop controls and namespace
    "chatml": """{% set ns = namespace(n=0) %}
{% for message in messages %}
{% if message['role'] == 'tool' %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}{% if message.name is defined %} {{ message | tojson }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}""",
}

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello <b>&</b> ünïcode"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [{"role": "user", "content": "x", "name": "bob"}, {"role": "tool", "content": "skipped"}],
]


def hf_tokenizer(tmp_path: Path, template: str) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return PreTrainedTokenizerFast.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(
    tmp_path: Path, name: str, conversation: int, add_generation_prompt: bool
) -> None:
    template, messages = TEMPLATES[name], CONVERSATIONS[conversation]
    tokenizer = hf_tokenizer(tmp_path, template)
    try:
        expected = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # transformers refuses: so must we, with a clear message
        with pytest.raises(ChatTemplateError, match="alternate"):
            render_chat(
                template,
                messages,
                add_generation_prompt=add_generation_prompt,
                bos_token="<s>",
                eos_token="</s>",
            )
        assert "alternate" in str(exc)
        return
    got = render_chat(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert got == expected


@pytest.mark.skipif(not (TINY / "tokenizer_config.json").exists(), reason="tiny model not built")
def test_tiny_llama_template_matches_transformers() -> None:
    from kvpilot.runtime.models.tokenizer_files import Tokenizer as KvTokenizer

    ours = KvTokenizer(TINY)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(TINY))
    for messages in CONVERSATIONS[:2]:
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        got = render_chat(
            ours.chat_template, messages, bos_token=ours.bos_token, eos_token=ours.eos_token
        )
        assert got == expected


@pytest.mark.parametrize(
    ("template", "match"),
    [
        (None, "no chat template"),
        ("{% for %}", "does not compile"),
        ("{{ raise_exception('nope') }}", "nope"),
        ("{{ messages.__class__.__mro__ }}", "rejected|unsafe|attribute"),
        ("{{ ''.__class__.__subclasses__() }}", "rejected|unsafe|attribute"),
        ("{{ messages[0]['content'] / 0 }}", "failed"),
    ],
)
def test_template_failures_are_value_errors(template: str | None, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(template, [{"role": "user", "content": "hi"}])


def test_sandbox_is_immutable() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(
            "{% set _ = messages.append(1) %}{{ messages }}", [{"role": "user", "content": "x"}]
        )


def test_none_valued_keys_are_dropped_like_transformers() -> None:
    template = "{% for m in messages %}{{ 'name' if m.name is defined else 'anon' }}{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": "x", "name": None}]) == "anon"

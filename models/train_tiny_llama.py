"""Train the tiny Llama test model in models/tiny-llama/ (reproducible, minutes on 2 CPU cores).

    .venv/bin/python models/train_tiny_llama.py [--out models/tiny-llama] [--steps 240]

Text that every machine with Python 3.11 has: the reference-manual topics in `pydoc_data.topics`
plus the docstrings of a fixed list of pure-Python standard-library modules (read with `ast`,
nothing is imported). Every 8th topic (sorted by name) is held out and written to `eval.txt`;
the tests and `kvpilot-runtime eval` measure perplexity on it, so the quantisation loss is
measured on a model that has learned something rather than on random weights.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 1234
VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH_SIZE = 16
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# The encoder adds <s> itself (post-processor), so the template does not: rendering a chat and
# encoding it yields exactly one BOS, as with Qwen-style templates.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DOCSTRING_MODULES = [
    "argparse",
    "ast",
    "asyncio/base_events",
    "asyncio/events",
    "asyncio/tasks",
    "base64",
    "bisect",
    "calendar",
    "collections/__init__",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email/message",
    "enum",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "http/client",
    "http/cookiejar",
    "imaplib",
    "inspect",
    "ipaddress",
    "json/__init__",
    "json/decoder",
    "locale",
    "logging/__init__",
    "mailbox",
    "numbers",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re/__init__",
    "sched",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "typing",
    "unittest/case",
    "urllib/parse",
    "urllib/request",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
]


def load_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def stdlib_docstrings() -> list[str]:
    """Module, class and function docstrings of DOCSTRING_MODULES, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for name in DOCSTRING_MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = [tree, *ast.walk(tree)]
        for node in nodes:
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    docs.append(doc)
    return list(dict.fromkeys(docs))


def split_corpus() -> tuple[list[str], list[str]]:
    """Training documents (plain and chat-formatted) and held-out evaluation documents."""
    topics = load_topics()
    train: list[str] = []
    held_out: list[str] = []
    for index, (name, text) in enumerate(topics.items()):
        if index % 8 == 3:
            held_out.append(text)
            continue
        train.append(text)
        answer = text.strip()[:1200]
        train.append(f"<|user|>\nExplain {name}.<|end|>\n<|assistant|>\n{answer}<|end|>\n")
    train.extend(stdlib_docstrings())
    return train, held_out


def special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer lacks the special token {token}")
    return int(token_id)


def train_tokenizer(docs: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    bos_id = special_id(tokenizer, "<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tokenizer


def build_stream(tokenizer: Tokenizer, docs: list[str]) -> torch.Tensor:
    eos_id = special_id(tokenizer, "</s>")
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc).ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def build_config(tokenizer: Tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=special_id(tokenizer, "<s>"),
        eos_token_id=special_id(tokenizer, "</s>"),
        pad_token_id=special_id(tokenizer, "<pad>"),
    )


def learning_rate(step: int, num_steps: int, peak: float) -> float:
    warmup = max(1, num_steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, stream: torch.Tensor, num_steps: int) -> None:
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    start = time.time()
    for step in range(num_steps):
        # batch: [BATCH_SIZE, SEQ_LEN] random windows of the token stream
        offsets = torch.randint(0, len(stream) - SEQ_LEN, (BATCH_SIZE,), generator=generator)
        batch = torch.stack([stream[o : o + SEQ_LEN] for o in offsets.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, num_steps, 3e-3)
        # transformers shifts the labels itself, so inputs and labels are the same window
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == num_steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, stream: torch.Tensor) -> float:
    model.eval()
    windows = stream[: len(stream) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)  # [num_windows, SEQ_LEN]
    losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    return math.exp(sum(losses) / len(losses))


def write_files(
    out: Path, model: LlamaForCausalLM, tokenizer: Tokenizer, held_out: list[str]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation_config = {
        "bos_token_id": special_id(tokenizer, "<s>"),
        "eos_token_id": [special_id(tokenizer, "</s>"), special_id(tokenizer, "<|end|>")],
        "pad_token_id": special_id(tokenizer, "<pad>"),
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    (out / "eval.txt").write_text("\n\n".join(doc.strip() for doc in held_out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "tiny-llama"))
    parser.add_argument("--steps", type=int, default=240)
    args = parser.parse_args()
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    train_docs, held_out = split_corpus()
    tokenizer = train_tokenizer(train_docs)
    stream = build_stream(tokenizer, train_docs)
    eval_stream = build_stream(tokenizer, held_out)
    print(f"train tokens {len(stream)}, eval tokens {len(eval_stream)}", flush=True)
    model = LlamaForCausalLM(build_config(tokenizer))
    print(f"parameters {sum(p.numel() for p in model.parameters())}", flush=True)
    train(model, stream, args.steps)
    print(f"eval perplexity (fp32) {perplexity(model, eval_stream):.2f}", flush=True)
    write_files(Path(args.out), model, tokenizer, held_out)


if __name__ == "__main__":
    main()

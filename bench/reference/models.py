"""Reference models and runs the runtime's correctness tests share: our logits and transformers'
on the same checkpoint, a random Qwen3 checkpoint, and tiny-llama prompts run through the
engine. Here rather than in one test module so that no test module imports another."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.engine.block_manager import BlockManager
from kvpilot.runtime.engine.engine import Engine
from kvpilot.runtime.engine.model_runner import ModelRunner, batch_layout, load_model
from kvpilot.runtime.engine.sampling import SamplingParams
from kvpilot.runtime.engine.scheduler import ScheduledSequence
from kvpilot.runtime.engine.sequence import Sequence
from kvpilot.runtime.models.loader import load_model_config

TINY_LLAMA = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
QWEN3_VOCAB = 4096  # tiny-llama's tokenizer, so the engine can load the checkpoint as a model dir
QWEN3_PROMPTS = [list(range(3, 90)), [7, 8, 9], [1, 400, 4000, 17, 17, 17]]
GREEDY_NEW_TOKENS = 24  # tokens each tiny-llama prompt generates in run_all
NUM_PROMPTS = 32


def our_logits(
    model_dir: Path,
    prompts: list[list[int]],
    chunks: list[int],
    decode_group_limits: tuple[int, int] | None = None,
    quantization: str = "none",
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Run all prompts together, split into the given chunk sizes per step (the last chunk is
    the rest); returns logits [len(prompt), vocab] per prompt, assembled over the steps."""
    cfg = load_model_config(model_dir)
    model = load_model(model_dir, cfg, quantization, dtype, torch.device("cpu"))
    runner = ModelRunner(model, torch.device("cpu"), seed=0)
    if decode_group_limits is not None:
        runner.decode_group_limits = decode_group_limits
    runner.allocate_kv_cache(64)
    bm = BlockManager(64)
    seqs = [Sequence(str(i), p) for i, p in enumerate(prompts)]
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(len(chunks) + 1):
        batch = []
        for seq in seqs:
            left = seq.num_tokens - seq.num_computed_tokens
            size = chunks[step] if step < len(chunks) else left
            if min(size, left) > 0:
                bm.allocate_slots(seq, min(size, left))
                batch.append(ScheduledSequence(seq, min(size, left)))
        input_ids, positions, meta, _ = runner.prepare(batch)
        hidden = model.forward(input_ids, positions, runner.kv_caches, meta)
        logits = model.compute_logits(hidden)
        start = 0
        for item in batch_layout(batch):  # the runner's row order
            pieces[int(item.seq.request_id)].append(logits[start : start + item.num_new_tokens])
            start += item.num_new_tokens
            item.seq.num_computed_tokens += item.num_new_tokens
    return [torch.cat(p) for p in pieces]


def hf_logits(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float()


def truncated_llama(path: Path, num_layers: int, source: Path = TINY_LLAMA) -> Path:
    """A Llama checkpoint's embeddings, first `num_layers` layers, norm and head, with its
    tokenizer (one safetensors file): a draft model that agrees with it often but not always
    (layer-skip self-speculation)."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in tensors.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, path / name)
    return path


def qwen3_checkpoint(path: Path, tied: bool, dtype: torch.dtype = torch.float32) -> Any:
    """A random Qwen3 with head_dim (48) unequal to hidden/heads (16): head_dim must come from
    the config. Norm weights are randomised too: transformers initialises them to ones, which
    would let a model that skipped q_norm/k_norm pass."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tied,
        initializer_range=0.1,  # peaked logits: greedy choices are not near-ties
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(3)
    model: Any = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_LLAMA / name, path / name)
    return model.eval()


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens after `prompt`, exactly `max_new_tokens` of them."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return list(out[0, len(prompt) :].tolist())


def make_prompts(tiny_llama_dir: Path, shared_prefix: int) -> list[list[int]]:
    """32 prompts of 4 to ~200 tokens cut from the held-out text; with `shared_prefix`, groups
    of 8 prompts begin with the same `shared_prefix` tokens."""
    from kvpilot.runtime.models.tokenizer_files import Tokenizer

    ids = Tokenizer(tiny_llama_dir).encode((tiny_llama_dir / "eval.txt").read_text())
    rng = random.Random(7)
    prompts = []
    for index in range(NUM_PROMPTS):
        length = rng.choice([4, 9, 17, 33, 64, 120, 200])
        start = rng.randrange(1, len(ids) - 2 * length)
        body = ids[start : start + length]
        if shared_prefix:
            group = index % 4
            body = ids[1000 * group + 1 : 1000 * group + 1 + shared_prefix] + body[:40]
        prompts.append([ids[0], *body])
    return prompts


def quoting(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts that quote themselves (a span twice), as summaries and code edits do: prompt
    lookup finds proposals from the first step."""
    return [[p[0], *p[1:41], *p[1:41]] for p in prompts]


def run_all(
    engine: Engine, prompts: list[list[int]], params: SamplingParams | None = None
) -> dict[str, list[int]]:
    """Every prompt's output tokens by request id (its index), all run together; greedy unless
    `params` says otherwise."""
    params = params or SamplingParams(max_tokens=GREEDY_NEW_TOKENS, temperature=0)
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, str(index))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens

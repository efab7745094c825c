"""A Llama checkpoint of a given shape with random weights, written with no network: config.json,
model.safetensors (bf16), and a byte-level tokenizer as wide as the model's vocabulary (ids below
256 are the bytes, the others the text `t{i}`, the last two BOS and EOS), so any token id
decodes, and llguidance (structured outputs) takes it as it takes Llama 3's. For timing a
model's shape (Llama-3.1-8B's: what the published vLLM and SGLang figures used) where its
weights cannot be fetched; the numbers it produces are speed, never quality.

    python -m bench.gpu.random_checkpoint DIR [--shape llama-3.1-8b|tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

# Llama-3.1-8B's config.json, less its rope scaling (irrelevant to speed at these lengths).
LLAMA_31_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
# The CPU dry run's: the same code path at a size a CPU runs in seconds.
TINY: dict[str, Any] = LLAMA_31_8B | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
}
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "tiny": TINY}
BOS_TEXT, EOS_TEXT = "<|bos|>", "<|eos|>"
NUM_BYTES = 256
WEIGHT_STD = 0.02  # transformers' initializer_range for Llama


def tensor_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint of `shape` holds, by its transformers name."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, vocab = shape["head_dim"], shape["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def random_tensor(name: str, size: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm weights 1 (as initialised), matrices N(0, WEIGHT_STD), made on the generator's
    device (a GPU makes 8B parameters in seconds), stored bf16 on the host."""
    device = generator.device
    if name.endswith("norm.weight"):
        return torch.ones(size, dtype=torch.bfloat16)
    values = torch.randn(size, generator=generator, device=device, dtype=torch.float32)
    return values.mul_(WEIGHT_STD).to(torch.bfloat16).cpu()


def special_ids(vocab_size: int) -> tuple[int, int]:
    """(BOS, EOS): the vocabulary's last two ids."""
    return vocab_size - 2, vocab_size - 1


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """tokenizer.json (byte-level BPE without merges: text encodes byte by byte, every id
    decodes), its config and generation_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size <= NUM_BYTES + 2:
        raise ValueError(f"the vocabulary needs more than {NUM_BYTES + 2} ids, got {vocab_size}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = [f"t{i}" for i in range(NUM_BYTES, vocab_size - 2)]
    vocab = {text: i for i, text in enumerate([*alphabet, *words, BOS_TEXT, EOS_TEXT])}
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS_TEXT, special=True),
                                  AddedToken(EOS_TEXT, special=True)])  # fmt: skip
    tokenizer.save(str(path / "tokenizer.json"))
    special = {"bos_token": BOS_TEXT, "eos_token": EOS_TEXT, "model_max_length": 131072}
    (path / "tokenizer_config.json").write_text(json.dumps(special))
    bos, eos = special_ids(vocab_size)
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    (path / "generation_config.json").write_text(json.dumps(generation))


def write_random_checkpoint(
    path: Path, shape: dict[str, Any], device: str = "cpu", seed: int = 0
) -> Path:
    """The checkpoint at `path` (made once: a `.complete` marker says it is whole)."""
    from safetensors.torch import save_file

    if (path / ".complete").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    bos, eos = special_ids(shape["vocab_size"])
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos,
              "hidden_act": "silu", **shape}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: random_tensor(name, size, generator)
               for name, size in tensor_shapes(shape).items()}  # fmt: skip
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path, shape["vocab_size"])
    (path / ".complete").touch()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--device", default="cpu", help="where the random numbers are drawn")
    args = parser.parse_args(argv)
    print(write_random_checkpoint(args.path, SHAPES[args.shape], args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

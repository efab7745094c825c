"""Random PEFT LoRA adapters for tiny-llama and transformers + peft as their reference, shared by
the LoRA tests and benchmark. Every adapter's lora_B is random (PEFT starts it at zero, which
would make an adapter that does nothing and a test that cannot fail)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.reference.models import TINY_LLAMA

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    alpha: int = 16
    use_rslora: bool = False
    seed: int = 0


# Four shapes of adapter: ranks 2 to 16, attention only, MLP only, everything, rsLoRA scaling.
MIXED_ADAPTERS = (
    AdapterSpec("qv8", 8, ("q_proj", "v_proj"), seed=1),
    AdapterSpec("all16", 16, ALL_MODULES, alpha=32, use_rslora=True, seed=2),
    AdapterSpec("mlp4", 4, ("gate_proj", "up_proj", "down_proj"), alpha=8, seed=3),
    AdapterSpec("ko2", 2, ("k_proj", "o_proj"), alpha=4, seed=4),
)


def load_base(model_dir: Path = TINY_LLAMA, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def make_adapter(base: Any, spec: AdapterSpec, path: Path, scale: float = 0.05) -> Any:
    """Save a random adapter of `spec` for `base` at `path`; the PEFT model that applies it
    (on its own copy of the base) is the reference."""
    model = peft_model(copy.deepcopy(base), spec)
    save_random_adapter(model, spec.seed, path, scale)
    return model.eval()


def peft_model(base: Any, spec: AdapterSpec) -> Any:
    """`base` (changed in place) wrapped by PEFT with an adapter of `spec`'s shape."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    return get_peft_model(base, config)


def save_random_adapter(model: Any, seed: int, path: Path, scale: float = 0.05) -> None:
    """Fill `model`'s LoRA weights with random values of `seed` and save the adapter at `path`:
    one PEFT model writes many adapters of one shape (a benchmark's hundred on a large base,
    where a copy of the base per adapter would take minutes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(str(path))


def reference_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The log-softmax [len(tokens), vocab] at each output position, the outputs given (one
    forward pass, teacher-forced): greedy decoding produced `tokens` iff each is its row's
    argmax."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)

"""Random weights for tiny models (``tiny_model``) and tiny replicas (``model_likes``) alike: a 🤗 model built
from a config, initialised with a wide std, its norms and biases made non-trivial, saved with its tokenizer.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

#: Std of the random init. Larger than the usual 0.02 so a random model's logits are spread out and greedy
#: decoding does not collapse to one repeated token.
INIT_STD = 0.2

#: Final norms whose scale gets random signs (see ``_perturb_constant_params``).
FINAL_NORM_WEIGHTS = frozenset({"model.norm.weight", "transformer.ln_f.weight"})


@torch.no_grad()
def _perturb_constant_params(model: torch.nn.Module, seed: int, std: float) -> None:
    """Give norm weights and biases (initialised to exactly 1 / 0) random values.

    A block server that forgets to load a bias or a norm weight would otherwise still match the reference.
    The final norm also gets random signs: with a tied LM head, logits ≈ <hidden, embedding>, and a random
    model whose residual stream is dominated by the current token's embedding would just echo that token
    forever under greedy decoding.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.dim() != 1:
            continue
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
        if name.endswith("bias"):
            param.copy_(noise.to(param.dtype))
            continue
        scale = 1.0 + noise  # norm scale
        if name in FINAL_NORM_WEIGHTS:
            scale *= torch.randint(0, 2, param.shape, generator=gen).to(torch.float32) * 2 - 1
        param.copy_(scale.to(param.dtype))


def save_random_model(
    out_dir: str | pathlib.Path, config: Any, tokenizer: Any, seed: int, std: float
) -> pathlib.Path:
    """Random float32 weights for ``config`` (EOS/pad ids from it) saved with ``tokenizer`` to ``out_dir``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = pathlib.Path(out_dir).expanduser()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_constant_params(model, seed, std)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

"""A small random-weight Llama checkpoint that vLLM loads like a real one (no hub, no tokenizer).

Run with the vLLM environment's Python (it has ``transformers``)::

    .venv-vllm/bin/python tests/vllm/tiny_model.py DIR

4 layers, 8 query heads, 4 KV heads (GQA), head_dim 32, vocabulary 4096: ~9 MB in bfloat16.
The weights are drawn with a large ``initializer_range`` so that a continuation depends on the
whole context (vLLM's ``load_format="dummy"`` weights are too small for that: every prompt
continues alike, and a token-equality oracle could not fail).
"""

from __future__ import annotations

import sys


def write(path: str, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


if __name__ == "__main__":
    write(sys.argv[1])

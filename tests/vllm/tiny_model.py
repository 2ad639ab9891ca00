"""A small random-weight Llama checkpoint that vLLM loads like a real one (no hub, no tokenizer).

Run with the vLLM environment's Python (it has ``transformers``)::

    .venv-vllm/bin/python tests/vllm/tiny_model.py DIR [--mla | --sliding] [--layers N]

``--mla`` writes a DeepSeek-V2-style model instead (multi-head latent
attention: one compressed KV latent per token and layer, 2 dense layers), for the MLA case.
``--sliding`` makes layers 1 and 3 sliding-window layers (64 tokens, as Gemma and Mistral
models mix them with full attention): vLLM's hybrid KV cache manager then keeps two KV cache
groups. ``--layers`` and ``--kv-heads`` shrink the Llama (one layer with one KV head on a
prefill TP 2 leaves one rank without a route).

4 layers, 8 query heads, 4 KV heads (GQA), head_dim 32, vocabulary 4096: ~9 MB in bfloat16.
The weights are drawn with a large ``initializer_range`` so that a continuation depends on the
whole context (vLLM's ``load_format="dummy"`` weights are too small for that: every prompt
continues alike, and a token-equality oracle could not fail).
"""

from __future__ import annotations

import argparse

SLIDING_WINDOW = 64


def write(
    path: str, seed: int = 0, *, sliding: bool = False, layers: int = 4, kv_heads: int = 4
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    mixed: dict[str, object] = {}
    if sliding:
        mixed = {
            "layer_types": ["full_attention", "sliding_attention"] * (layers // 2),
            "sliding_window": SLIDING_WINDOW,
        }
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.15,
        tie_word_embeddings=False,
        **mixed,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def write_mla(path: str, seed: int = 0) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,  # the CPU MLA kernel compiles for a 576-wide latent (512 + 64) only
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=2,  # every layer dense: no experts
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        max_position_embeddings=2048,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--mla", action="store_true")
    kind.add_argument("--sliding", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    if args.mla:
        write_mla(args.path)
    else:
        write(args.path, sliding=args.sliding, layers=args.layers, kv_heads=args.kv_heads)

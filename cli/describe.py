"""Registration bodies from Hugging Face style model configs (``kvplane describe``).

For engines that do not speak kvplane yet: read ``config.json`` of the served model (and optionally
of its speculative draft model), add the parallelism, and get the ``PUT /v1/instances/{name}`` body.

Fields read (``text_config`` is used when present, as in multimodal configs):

- ``num_hidden_layers``; ``num_key_value_heads`` (default ``num_attention_heads``);
- ``head_dim``, else ``hidden_size / num_attention_heads``;
- ``torch_dtype`` / ``dtype`` (default ``bfloat16``), overridable (``float8_e4m3fn``, ``nvfp4``);
- MLA (DeepSeek style, detected by ``kv_lora_rank``): one latent K-only buffer per layer of
  ``kv_lora_rank + qk_rope_head_dim`` elements per token, identical on every TP rank, so the view
  is ``REPLICATED`` with roles ``["key"]``.

A draft config contributes its own layers (``num_hidden_layers``, e.g. 1 for EAGLE-style drafts)
and head geometry, as a ``draft``-owned view in the same pool as the target.

Hybrid configs (Mamba2 / Mamba + attention, detected by ``mamba_d_state`` / ``state_size``) add a
per-request state group: see :mod:`cli.describe_hybrid`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cli.describe_hybrid import (
    HybridConfigError,
    attention_layers,
    describe_hybrid,
    hybrid_spec,
    is_hybrid,
)
from geometry.builders import ELEMENT_BYTES, ViewSpec, instance_body


class ConfigError(ValueError):
    """A model config lacks a field kvplane needs, or holds an unusable value."""


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def _positive_int(config: Mapping[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def view_spec(
    config: Mapping[str, Any],
    *,
    owner: str,
    layout: str,
    dtype: str | None = None,
    source: str = "config",
) -> ViewSpec:
    """The view class a model config implies (MLA → replicated K-only latent view)."""
    config = _text_config(config)
    layers = _positive_int(config, "num_hidden_layers", source)
    chosen = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if not isinstance(chosen, str):
        raise ConfigError(f"{source}: dtype must be a string, got {chosen!r}")
    if "kv_lora_rank" in config:
        latent = _positive_int(config, "kv_lora_rank", source)
        rope = config.get("qk_rope_head_dim", 0)
        if isinstance(rope, bool) or not isinstance(rope, int) or rope < 0:
            raise ConfigError(f"{source}: qk_rope_head_dim must be an integer ≥ 0, got {rope!r}")
        return ViewSpec(
            owner,
            layers,
            1,
            latent + rope,
            layout="REPLICATED",
            dtype=chosen,
            k_only=True,
            replicated=True,
        )
    attention_heads = _positive_int(config, "num_attention_heads", source)
    kv_heads = config.get("num_key_value_heads", attention_heads)
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ConfigError(f"{source}: num_key_value_heads must be a positive integer")
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _positive_int(config, "hidden_size", source)
        if hidden % attention_heads:
            raise ConfigError(
                f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{attention_heads}; give head_dim"
            )
        head_dim = hidden // attention_heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"{source}: head_dim must be a positive integer, got {head_dim!r}")
    return ViewSpec(owner, layers, kv_heads, head_dim, layout=layout, dtype=chosen)


def describe(
    config: Mapping[str, Any],
    *,
    role: str,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    attention_dp: bool = False,
    tokens_per_block: int = 32,
    layout: str = "HND",
    dtype: str | None = None,
    num_slots: int = 1024,
    draft_config: Mapping[str, Any] | None = None,
    pp_split: Sequence[int] | None = None,
    model: str | None = None,
    ssm_dtype: str | None = None,
    state_slots: int | None = None,
) -> dict[str, Any]:
    """The registration body for a model config served at the given parallelism."""
    if role not in ("context", "generation"):
        raise ConfigError(f"role must be context or generation, got {role!r}")
    if is_hybrid(_text_config(config)):
        return _describe_hybrid(
            config,
            role=role,
            tp=tp,
            pp=pp,
            cp=cp,
            attention_dp=attention_dp,
            tokens_per_block=tokens_per_block,
            layout=layout,
            dtype=dtype,
            ssm_dtype=ssm_dtype,
            num_slots=num_slots,
            state_slots=state_slots or num_slots,
            draft=draft_config is not None,
            pp_split=pp_split,
            model=model,
        )
    target = view_spec(config, owner="target", layout=layout, dtype=dtype, source="model config")
    views = [target]
    if draft_config is not None:
        views.append(
            view_spec(
                draft_config, owner="draft", layout=layout, dtype=dtype, source="draft config"
            )
        )
    for spec in views:
        if spec.dtype not in ELEMENT_BYTES:
            raise ConfigError(
                f"dtype {spec.dtype!r} has no known element size; choose one of "
                f"{', '.join(ELEMENT_BYTES)} with --dtype"
            )
        group = 1 if attention_dp else tp
        if not spec.replicated and (
            group % min(group, spec.kv_heads) or spec.kv_heads % min(group, spec.kv_heads)
        ):
            raise ConfigError(
                f"{spec.owner} model: {spec.kv_heads} KV heads cannot be sharded over TP {tp}"
            )
    name = model or _text_config(config).get("_name_or_path") or config.get("model_type")
    try:
        return instance_body(
            role=role,
            views=views,
            tp=tp,
            pp=pp,
            cp=cp,
            attention_dp=attention_dp,
            tokens_per_block=tokens_per_block,
            num_slots=num_slots,
            pp_split=pp_split,
            model=name if isinstance(name, str) else None,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _describe_hybrid(
    config: Mapping[str, Any],
    *,
    layout: str,
    dtype: str | None,
    ssm_dtype: str | None,
    draft: bool,
    **kw: Any,
) -> dict[str, Any]:
    text = _text_config(config)
    if draft:
        raise ConfigError("a draft model beside a hybrid model is not supported by describe yet")
    if layout != "HND":
        raise ConfigError("hybrid models are described with HND attention views only")
    chosen = dtype or text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    if not isinstance(chosen, str):
        raise ConfigError(f"model config: dtype must be a string, got {chosen!r}")
    try:
        layers = text.get("num_hidden_layers")
        has_attention = isinstance(layers, int) and bool(attention_layers(text, layers))
        kv_heads, head_dim = 1, 1  # unused without attention layers
        if has_attention:
            attention = view_spec(text, owner="target", layout="HND", dtype=chosen)
            kv_heads, head_dim = attention.kv_heads, attention.head_dim
            group = 1 if kw["attention_dp"] else kw["tp"]
            if group % min(group, kv_heads) or kv_heads % min(group, kv_heads):
                raise ConfigError(f"{kv_heads} KV heads cannot be sharded over TP {kw['tp']}")
        spec = hybrid_spec(
            text, kv_heads=kv_heads, head_dim=head_dim, dtype=chosen, ssm_dtype=ssm_dtype
        )
        name = kw.pop("model") or text.get("_name_or_path") or config.get("model_type")
        return describe_hybrid(spec, model=name if isinstance(name, str) else None, **kw)
    except HybridConfigError as error:
        raise ConfigError(str(error)) from error

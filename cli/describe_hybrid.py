"""Registration bodies for hybrid (Mamba2 / Mamba + attention) configs: ``kvplane describe``.

A config is *hybrid* when it carries Mamba fields (``mamba_d_state`` or ``state_size`` /
``ssm_state_size``). Fields read (``text_config`` first when present), first name found wins:

- layers: ``num_hidden_layers``; attention layers from ``layer_types`` / ``layers_block_type``
  (entries containing ``"attention"``), ``attn_layer_indices``, ``hybrid_override_pattern``
  (``*`` = attention), or ``attn_layer_period`` + ``attn_layer_offset`` (Jamba); none → every
  layer is recurrent (pure Mamba2);
- attention heads as in :mod:`cli.describe` (``num_key_value_heads``, ``head_dim`` …);
- ``d_state``: ``mamba_d_state`` / ``state_size`` / ``ssm_state_size``; ``d_conv``:
  ``mamba_d_conv`` / ``conv_kernel``; ``expand``: ``mamba_expand`` / ``expand``;
  ``d_inner = expand × hidden_size`` (or ``mamba_d_inner``);
- Mamba2 (SSM heads given by ``mamba_n_heads`` / ``mamba_num_heads`` / ``num_heads``, head size by
  ``mamba_d_head`` / ``mamba_head_dim``, or ``head_dim`` without attention layers): SSM state
  ``[heads][head_dim][d_state]``, conv sections ``(x, B, C) = (heads × head_dim, G × d_state,
  G × d_state)`` with ``G`` = ``mamba_n_groups`` / ``n_groups`` (default 1);
- Mamba1 (Jamba, no SSM heads): every channel of ``d_inner`` is one "head" of ``d_state``
  elements, conv state one section ``(d_inner,)``.

The conv state takes the model dtype; the SSM state ``mamba_ssm_cache_dtype`` /
``ssm_state_dtype`` if the config names one, else the model dtype (override with
``ssm_dtype``). Mamba2 groups must split over the state axis (``G % (tp × cp) == 0``): engines
replicate B and C when they do not, and replicated sections are not a ``SECTIONED`` shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from geometry.builders import ELEMENT_BYTES
from geometry.state_builders import HybridSpec, hybrid_body

STATE_KEYS = ("mamba_d_state", "state_size", "ssm_state_size")


class HybridConfigError(ValueError):
    """A hybrid config lacks a field, or its state does not split over the parallelism."""


def is_hybrid(config: Mapping[str, Any]) -> bool:
    """Whether a (text) config describes recurrent layers."""
    return any(key in config for key in STATE_KEYS)


def _first(config: Mapping[str, Any], keys: Sequence[str], default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HybridConfigError(f"model config: {what} must be a positive integer, got {value!r}")
    return value


def attention_layers(config: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Global ids of the attention layers of a hybrid config (see the module docstring)."""
    types = _first(config, ("layer_types", "layers_block_type"))
    if isinstance(types, list):
        if len(types) != layers:
            raise HybridConfigError(f"model config: {len(types)} layer types for {layers} layers")
        return tuple(i for i, kind in enumerate(types) if "attention" in str(kind))
    indices = config.get("attn_layer_indices")
    if isinstance(indices, list):
        return tuple(sorted(_layer(i, layers) for i in indices))
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if len(pattern) != layers:
            raise HybridConfigError(
                f"model config: hybrid_override_pattern has {len(pattern)} layers, not {layers}"
            )
        return tuple(i for i, kind in enumerate(pattern) if kind == "*")
    period = config.get("attn_layer_period")
    if period is not None:
        period = _positive(period, "attn_layer_period")
        offset = config.get("attn_layer_offset", 0)
        return tuple(i for i in range(layers) if i % period == offset)
    return ()


def _layer(value: Any, layers: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < layers:
        raise HybridConfigError(f"model config: attention layer {value!r} is not in [0, {layers})")
    return value


def hybrid_spec(
    config: Mapping[str, Any],
    *,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    ssm_dtype: str | None = None,
) -> HybridSpec:
    """The hybrid shape of a config; attention heads come from
    :func:`cli.describe.view_spec`."""
    layers = _positive(config.get("num_hidden_layers"), "num_hidden_layers")
    d_state = _positive(_first(config, STATE_KEYS), "d_state (mamba_d_state / state_size)")
    d_conv = _positive(_first(config, ("mamba_d_conv", "conv_kernel"), 4), "d_conv")
    if d_conv < 2:
        raise HybridConfigError("model config: d_conv must be ≥ 2 (the conv state keeps d_conv−1)")
    inner = _first(config, ("mamba_d_inner",))
    if inner is None:
        expand = _positive(_first(config, ("mamba_expand", "expand"), 2), "expand")
        hidden = _positive(config.get("hidden_size"), "hidden_size")
        inner = expand * hidden
    inner = _positive(inner, "d_inner")
    attention = attention_layers(config, layers)
    heads = _first(config, ("mamba_n_heads", "mamba_num_heads", "num_heads"))
    if heads is not None:  # Mamba2
        heads = _positive(heads, "SSM heads (mamba_n_heads / num_heads)")
        # a pure Mamba2 config names the SSM head size head_dim; a hybrid's is attention's
        keys = ("mamba_d_head", "mamba_head_dim") + (() if attention else ("head_dim",))
        ssm_head_dim = _positive(_first(config, keys, inner // heads), "SSM head_dim")
        groups = _positive(_first(config, ("mamba_n_groups", "n_groups"), 1), "n_groups")
        channels: tuple[int, ...] = (heads * ssm_head_dim, groups * d_state, groups * d_state)
    else:  # Mamba1: one "head" per channel
        heads, ssm_head_dim, groups = inner, 1, 0
        channels = (inner,)
    state_dtype = ssm_dtype or _first(config, ("mamba_ssm_cache_dtype", "ssm_state_dtype"), dtype)
    for name in (dtype, state_dtype):
        if name not in ELEMENT_BYTES:
            raise HybridConfigError(
                f"dtype {name!r} has no known element size; choose one of "
                f"{', '.join(ELEMENT_BYTES)}"
            )
    spec = HybridSpec(
        num_layers=layers,
        attention_layers=attention,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ssm_heads=heads,
        ssm_head_dim=ssm_head_dim,
        d_state=d_state,
        conv_channels=channels,
        d_conv=d_conv,
        dtype=dtype,
        ssm_dtype=state_dtype,
        ssm_groups=groups,
    )
    return spec


def describe_hybrid(
    spec: HybridSpec,
    *,
    role: str,
    tp: int,
    pp: int,
    cp: int,
    attention_dp: bool,
    tokens_per_block: int,
    num_slots: int,
    state_slots: int,
    pp_split: Sequence[int] | None,
    model: str | None,
) -> dict[str, Any]:
    """The registration body of a hybrid model at the given parallelism."""
    axis = 1 if attention_dp else tp * cp
    if spec.ssm_heads % axis:
        # the x conv section follows the heads: replicated heads would replicate it too
        raise HybridConfigError(
            f"{spec.ssm_heads} SSM heads cannot be sharded over a state axis of {axis} ranks "
            "(tp × cp, or 1 under attention-DP)"
        )
    try:
        return hybrid_body(
            role=role,
            spec=spec,
            tp=tp,
            pp=pp,
            cp=cp,
            attention_dp=attention_dp,
            tokens_per_block=tokens_per_block,
            num_slots=num_slots,
            state_slots=state_slots,
            pp_split=pp_split,
            model=model,
        )
    except ValueError as error:
        raise HybridConfigError(str(error)) from error

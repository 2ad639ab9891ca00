"""`kvplane describe` on hybrid (Mamba + attention) configs, and `kvplane check` on the bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.describe import ConfigError, describe
from cli.main import cli
from geometry import compile_plan, expand, parse_instance, validate_pairing

from .test_offline_check import MODELS, config, runner, write_body


def test_mamba2_hybrid_body_has_a_paged_and_a_state_group() -> None:
    body = describe(config("mamba2-hybrid"), role="context", tp=2, state_slots=64)
    assert body["layer_groups"] == [
        {"id": 0, "tokens_per_slot": 32},
        {"id": 1, "tokens_per_slot": None},
    ]
    rank = body["ranks"][1]
    kv, conv, ssm = rank["views"]
    assert [b["layer"] for b in kv["buffers"]] == [3, 3, 7, 7]
    assert kv["num_kv_heads"] == 2 and kv["total_kv_heads"] == 4
    # x = 16 heads × 64, B = C = 2 groups × 64 state: channels × (d_conv − 1) × 2 bytes
    assert conv["layout"] == "SECTIONED"
    assert conv["section_bytes"] == [1024 * 3 * 2, 128 * 3 * 2, 128 * 3 * 2]
    assert [b["layer"] for b in conv["buffers"]] == [0, 1, 2, 4, 5, 6]
    assert conv["buffers"][0]["size"] == (1024 + 256) * 3 * 2 // 2
    assert (ssm["layout"], ssm["num_kv_heads"], ssm["dtype"]) == ("HND", 8, "float32")
    assert ssm["buffers"][0]["size"] == 8 * 64 * 64 * 4  # heads × head_dim × d_state × fp32
    pools = {p["id"]: p for p in rank["pools"]}
    assert pools[1]["layer_group"] == 1 and pools[1]["num_slots"] == 64


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 1), (1, 2), (2, 2)])
def test_described_hybrid_bodies_pair_and_move_all_state(ctx_tp: int, gen_tp: int) -> None:
    ctx = parse_instance(describe(config("mamba2-hybrid"), role="context", tp=ctx_tp), "c")
    gen = parse_instance(describe(config("mamba2-hybrid"), role="generation", tp=gen_tp), "g")
    assert validate_pairing(ctx, gen).compatible
    expansion = expand(compile_plan(ctx, gen), {0: ([4, 5], [0, 1]), 1: ([3], [7])})
    state = 6 * ((1024 + 256) * 3 * 2 + 16 * 64 * 64 * 4)  # 6 Mamba layers, aggregated
    kv = 2 * 2 * 2 * 4 * 32 * 64 * 2  # blocks × layers × K/V × heads × tokens × dim × bf16
    assert expansion.bytes == state + kv


def test_jamba_like_mamba1_state_shards_channels(tmp_path: Path) -> None:
    ctx = write_body(tmp_path, "ctx", str(MODELS / "jamba-like.json"), "--role", "context")
    gen = write_body(
        tmp_path, "gen", str(MODELS / "jamba-like.json"), "--role", "generation", "--tp", "2"
    )
    ssm = json.loads(gen.read_text())["ranks"][0]["views"][2]
    assert (ssm["num_kv_heads"], ssm["total_kv_heads"]) == (256, 512)  # d_inner channels
    result = runner.invoke(cli, ["check", str(ctx), str(gen), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["compatible"]


def test_pure_mamba2_config_has_only_state() -> None:
    pure = {
        "model_type": "mamba2",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "state_size": 8,
        "expand": 2,
        "num_heads": 4,
        "head_dim": 32,
        "n_groups": 1,
        "conv_kernel": 4,
        "torch_dtype": "float16",
    }
    body = describe(pure, role="generation")
    (rank,) = body["ranks"]
    assert [p["layer_group"] for p in rank["pools"]] == [1]
    assert [v["roles"] for v in rank["views"]] == [["conv_state"], ["ssm_state"]]
    assert rank["views"][1]["buffers"][0]["size"] == 4 * 32 * 8 * 2


def test_groups_that_do_not_split_are_refused_without_a_traceback(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="groups"):
        describe(config("mamba2-hybrid"), role="context", tp=4)
    result = runner.invoke(
        cli, ["describe", str(MODELS / "mamba2-hybrid.json"), "--role", "context", "--tp", "4"]
    )
    assert result.exit_code == 2
    assert "Mamba2 groups" in result.output and "Traceback" not in result.output
    with pytest.raises(ConfigError, match="dtype"):
        describe(config("mamba2-hybrid"), role="context", ssm_dtype="float64")


def test_check_explains_a_state_mismatch(tmp_path: Path) -> None:
    ctx = write_body(tmp_path, "ctx", str(MODELS / "llama-3-8b.json"), "--role", "context")
    gen = write_body(tmp_path, "gen", str(MODELS / "mamba2-hybrid.json"), "--role", "generation")
    result = runner.invoke(cli, ["check", str(ctx), str(gen)])
    assert result.exit_code == 1, result.output
    assert "state_group_mismatch" in result.output
    assert "why: one side keeps per-request recurrent state" in result.output
    other = json.loads(gen.read_text())
    other["role"] = "context"
    for rank in other["ranks"]:
        for view in rank["views"]:
            if view["roles"] == ["ssm_state"]:
                view["d_state"] = 32
                for buffer in view["buffers"]:
                    buffer["size"] //= 2
    changed = tmp_path / "ctx2.json"
    changed.write_text(json.dumps(other))
    result = runner.invoke(cli, ["check", str(changed), str(gen)])
    assert result.exit_code == 1, result.output
    for code in ("state_bytes_mismatch", "d_state_mismatch"):
        assert code in result.output
    assert "why: the TP-aggregated bytes of one layer's state differ" in result.output


def test_a_bad_state_body_is_exit_2_naming_the_field(tmp_path: Path) -> None:
    ctx = write_body(tmp_path, "ctx", str(MODELS / "mamba2-hybrid.json"), "--role", "context")
    gen = write_body(tmp_path, "gen", str(MODELS / "mamba2-hybrid.json"), "--role", "generation")
    body = json.loads(gen.read_text())
    body["ranks"][0]["views"][1]["section_bytes"] = [1, 2]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(body))
    result = runner.invoke(cli, ["check", str(ctx), str(bad)])
    assert result.exit_code == 2
    assert "generation.ranks.0.views.1.buffers.0.size" in result.output
    assert "sections [1, 2]" in result.output and "Traceback" not in result.output

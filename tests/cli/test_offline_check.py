"""`kvplane describe` bodies from model configs pair exactly as the planning core says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.describe import ConfigError, describe
from cli.main import cli
from geometry import compile_plan, parse_instance, validate_pairing

MODELS = Path(__file__).resolve().parents[1] / "data" / "models"
runner = CliRunner()


def config(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


def write_body(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / f"{name}.json"
    result = runner.invoke(cli, ["describe", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_llama_tp4_with_eagle_draft_feeds_tp2(tmp_path: Path) -> None:
    draft = str(MODELS / "eagle-draft.json")
    llama = str(MODELS / "llama-3-8b.json")
    ctx = write_body(tmp_path, "ctx", llama, "--role", "context", "--tp", "4", "--draft", draft)
    gen = write_body(tmp_path, "gen", llama, "--role", "generation", "--tp", "2", "--draft", draft)
    body = json.loads(ctx.read_text())
    views = body["ranks"][0]["views"]
    assert [(v["owner"], v["num_kv_heads"], v["total_kv_heads"]) for v in views] == [
        ("target", 2, 8),
        ("draft", 1, 2),  # 2 draft heads over TP4: duplicated, one head per rank
    ]
    assert [b["layer"] for b in views[1]["buffers"]] == [32, 32]  # draft layer after the target's
    result = runner.invoke(cli, ["check", str(ctx), str(gen), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["compatible"] and report["errors"] == []
    (plan,) = report["plans"]
    # 4 context ranks → 2 generation ranks: every context rank writes target heads.
    assert plan["routes"] == 4
    assert [r["writers"] for r in plan["receivers"]] == [[0, 1], [2, 3]]
    # Draft replicas on context ranks 0/1 and 2/3: one of each pair writes the draft bytes, so
    # writers carry different bytes and the legacy equal split would be wrong.
    assert [r["equal_split_safe"] for r in plan["receivers"]] == [False, False]


def test_qwen_two_kv_heads_tp8_duplication_to_tp2() -> None:
    ctx = parse_instance(describe(config("qwen-gqa-2kv"), role="context", tp=8), "ctx")
    gen = parse_instance(describe(config("qwen-gqa-2kv"), role="generation", tp=2), "gen")
    assert validate_pairing(ctx, gen).compatible
    plan = compile_plan(ctx, gen)
    # Context ranks 0-3 hold head 0, 4-7 head 1; generation rank 0 holds head 0, rank 1 head 1.
    # The 28 layers of a head are split over its 4 replicas: 7 contiguous layers each.
    pairs = [(r.sender_rank, r.receiver_rank) for r in plan.routes]
    assert pairs == [(r, r // 4) for r in range(8)]
    assert [r.slices[0]["layers"][0] for r in plan.routes] == [0, 7, 14, 21] * 2
    assert len({r.bytes_per_block for r in plan.routes}) == 1


def test_deepseek_mla_is_a_replicated_key_only_view() -> None:
    body = describe(config("deepseek-mla"), role="context", tp=8)
    view = body["ranks"][3]["views"][0]
    assert view["layout"] == "REPLICATED" and view["roles"] == ["key"]
    assert view["buffers"][0]["size"] == 32 * (512 + 64) * 2
    ctx = parse_instance(body, "ctx")
    gen = parse_instance(describe(config("deepseek-mla"), role="generation", tp=4), "gen")
    plan = compile_plan(ctx, gen)
    # Every generation rank needs the whole latent cache (27 layers); the 8 identical context
    # replicas split the 4 × 27 layer copies into contiguous chunks of 14 or 13 layers.
    pairs = [(r.sender_rank, r.receiver_rank) for r in plan.routes]
    assert pairs == [(r, r // 2) for r in range(8)]
    assert [len(r.slices[0]["layers"]) for r in plan.routes] == [14, 13] * 4


def test_different_models_are_reported_with_codes_and_exit_1(tmp_path: Path) -> None:
    ctx = write_body(tmp_path, "ctx", str(MODELS / "llama-3-8b.json"), "--role", "context")
    gen = write_body(tmp_path, "gen", str(MODELS / "qwen-gqa-2kv.json"), "--role", "generation")
    result = runner.invoke(cli, ["check", str(ctx), str(gen), "--json"])
    assert result.exit_code == 1
    codes = {issue["code"] for issue in json.loads(result.output)["errors"]}
    assert {"model_mismatch", "head_count_mismatch"} <= codes


def test_check_rejects_a_broken_body_with_the_field_and_exit_2(tmp_path: Path) -> None:
    ctx = write_body(tmp_path, "ctx", str(MODELS / "llama-3-8b.json"), "--role", "context")
    body = json.loads(ctx.read_text())
    body["ranks"][0]["views"][0]["buffers"][0]["size"] = 1 << 30  # outside the slot
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(body))
    result = runner.invoke(cli, ["check", str(broken), str(ctx), "--json"])
    assert result.exit_code == 2
    (first, *_) = json.loads(result.output)["errors"]
    assert first["loc"][:4] == ["context", "ranks", 0, "views"]


def test_check_refuses_a_file_that_is_not_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = runner.invoke(cli, ["check", str(bad), str(bad)])
    assert result.exit_code == 2


def test_describe_needs_usable_config_fields() -> None:
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        describe({"num_attention_heads": 8}, role="context")
    with pytest.raises(ConfigError, match="cannot be sharded"):
        describe({**config("llama-3-8b"), "num_key_value_heads": 3}, role="context", tp=2)


def test_kvplane_check_runs_as_a_real_command(tmp_path: Path) -> None:
    llama = str(MODELS / "llama-3-8b.json")
    ctx = write_body(tmp_path, "ctx", llama, "--role", "context", "--tp", "2")
    gen = write_body(tmp_path, "gen", llama, "--role", "generation", "--tp", "8", "--layout", "HND")
    kvplane = Path(sys.executable).with_name("kvplane")
    done = subprocess.run(
        [str(kvplane), "check", str(ctx), str(gen)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "compatible" in done.stdout and "8 routes" in done.stdout


def test_check_of_two_files_with_the_same_stem_plans_each_side(tmp_path: Path) -> None:
    llama = str(MODELS / "llama-3-8b.json")
    (tmp_path / "prod").mkdir()
    (tmp_path / "canary").mkdir()
    ctx = write_body(tmp_path / "prod", "llama", llama, "--role", "context", "--tp", "4")
    gen = write_body(tmp_path / "canary", "llama", llama, "--role", "generation", "--tp", "2")
    other = write_body(tmp_path, "gen", llama, "--role", "generation", "--tp", "2")
    same = runner.invoke(cli, ["check", str(ctx), str(gen), "--json"])
    apart = runner.invoke(cli, ["check", str(ctx), str(other), "--json"])
    assert same.exit_code == apart.exit_code == 0, same.output
    assert json.loads(same.output) == json.loads(apart.output)


def test_check_explains_a_layout_conversion(tmp_path: Path) -> None:
    llama = str(MODELS / "llama-3-8b.json")
    ctx = write_body(tmp_path, "ctx", llama, "--role", "context", "--tp", "4", "--layout", "HND")
    gen = write_body(tmp_path, "gen", llama, "--role", "generation", "--tp", "2", "--layout", "NHD")
    result = runner.invoke(cli, ["check", str(ctx), str(gen)])
    assert result.exit_code == 0, result.output
    assert "layout_conversion" in result.output
    assert "why: the two sides store this view's heads in different orders" in result.output
    assert "generation rank 0 <- context ranks [0, 1]" in result.output


def test_check_explains_a_missing_peer_shard(tmp_path: Path) -> None:
    llama = str(MODELS / "llama-3-8b.json")
    ctx = write_body(tmp_path, "ctx", llama, "--role", "context", "--tp", "2")
    body = json.loads(ctx.read_text())
    view = body["ranks"][1]["views"][0]
    view["buffers"] = [b for b in view["buffers"] if b["layer"] != 3]
    ctx.write_text(json.dumps(body))
    gen = write_body(tmp_path, "gen", llama, "--role", "generation", "--tp", "1")
    result = runner.invoke(cli, ["check", str(ctx), str(gen)])
    assert result.exit_code == 1, result.output  # was a traceback from compile_plan
    assert "missing_peer_shard" in result.output and "why: some context ranks" in result.output


def test_check_explains_a_block_size_ratio_in_words(tmp_path: Path) -> None:
    llama = str(MODELS / "llama-3-8b.json")
    ctx = write_body(tmp_path, "ctx", llama, "--role", "context", "--tp", "4",
                     "--tokens-per-block", "16", "--num-slots", "64")  # fmt: skip
    gen = write_body(tmp_path, "gen", llama, "--role", "generation", "--tp", "2",
                     "--tokens-per-block", "64", "--num-slots", "64")  # fmt: skip
    result = runner.invoke(cli, ["check", str(ctx), str(gen)])
    assert result.exit_code == 0, result.output
    assert "tokens_per_block_ratio" in result.output
    assert "each generation block pairs with 4 consecutive context blocks" in result.output
    assert "why: the sides page tokens differently: one block of the larger side" in result.output
    assert "bytes per generation block (4 context blocks)" in result.output
    report = json.loads(runner.invoke(cli, ["check", str(ctx), str(gen), "--json"]).output)
    assert [(p["block_ratio"], p["large_side"]) for p in report["plans"]] == [(4, "generation")]


def test_check_refuses_a_block_size_ratio_with_its_reasons_and_no_traceback(
    tmp_path: Path,
) -> None:
    llama = str(MODELS / "llama-3-8b.json")
    ctx = write_body(tmp_path, "ctx", llama, "--role", "context", "--tp", "2",
                     "--tokens-per-block", "16", "--layout", "NHD", "--num-slots", "8")  # fmt: skip
    gen = write_body(tmp_path, "gen", llama, "--role", "generation", "--tp", "2",
                     "--tokens-per-block", "24", "--num-slots", "8")  # fmt: skip
    result = runner.invoke(cli, ["check", str(ctx), str(gen)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "tokens_per_block_mismatch" in result.output
    assert "24 is not a multiple of 16" in result.output
    assert "block-size ratios are supported for HND views only" in result.output
    assert "Traceback" not in result.output

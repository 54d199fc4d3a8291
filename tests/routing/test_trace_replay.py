"""``benchmarks.trace_replay``: a Mooncake-format trace through the placement simulation (real
coordinators, no cluster): the JSON line's structure, hit rates in [0, 1], the tree's baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import trace_replay
from benchmarks.support.mooncake_trace import TraceRow, block_tokens, build_trace, load_requests


def run_replay(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert trace_replay.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def check_report(report: dict, workers: list[int]) -> None:
    keys = {f"{layout}/W={w}" for layout in trace_replay.LAYOUTS for w in workers}
    assert set(report["runs"]) == keys and set(report["ratios"]) == keys
    for key in keys:
        runs = report["runs"][key]
        assert set(runs) == set(trace_replay.POLICIES)
        for policy, m in runs.items():
            assert 0.0 <= m["hit_rate"] <= 1.0, (key, policy)
            assert 0.0 <= m["ttft_p50_s"] <= m["ttft_p90_s"], (key, policy)
            assert m["decision_p50_us"] <= m["decision_p99_us"], (key, policy)
        assert runs["prefix_tree"]["false_hit_share"] is not None
        ratios = report["ratios"][key]
        assert set(ratios) == {
            "hit_ratio_vs_tree",
            "p90_ttft_ratio_vs_tree",
            "false_hit_kvfleet",
            "decision_p99_us",
            "hit_ceiling_vs_tree",
            "p90_ttft_floor_vs_tree",
        }
        # the bounds hold for every policy: no hit rate above the ceiling, no TTFT below the floor
        best = report["bounds"][key]
        for policy, m in runs.items():
            assert m["hit_rate"] <= best["hit_rate"] + 1e-4, (key, policy)
            assert m["ttft_p50_s"] >= best["ttft_p50_s"] - 1e-4, (key, policy)
            assert m["ttft_p90_s"] >= best["ttft_p90_s"] - 1e-4, (key, policy)
        assert ratios["p90_ttft_floor_vs_tree"] == pytest.approx(
            best["ttft_p90_s"] / runs["prefix_tree"]["ttft_p90_s"], abs=1e-3
        )
        assert ratios["hit_ratio_vs_tree"] == pytest.approx(
            runs["kvfleet"]["hit_rate"] / max(1e-9, runs["prefix_tree"]["hit_rate"]), abs=1e-3
        )
        assert 0.0 <= ratios["false_hit_kvfleet"] <= 1.0


def test_handmade_trace_shared_prefixes_hit_and_report_is_well_formed(tmp_path: Path, capsys):
    # 40 requests, 4 families sharing 3 hash blocks each, then 1 own block: prefix routers find hits
    path = tmp_path / "trace.jsonl"
    with path.open("w") as f:
        for i in range(40):
            family = i % 4
            ids = [100 * family + k for k in range(3)] + [10_000 + i]
            f.write(json.dumps({"timestamp": 200 * i, "input_length": 4 * 512, "output_length": 64, "hash_ids": ids}))
            f.write("\n")
    report = run_replay(capsys, ["--trace", str(path), "--scale", "16", "--workers", "2", "--warmup", "0.2"])
    check_report(report, [2])
    for layout in trace_replay.LAYOUTS:
        runs = report["runs"][f"{layout}/W=2"]
        assert runs["kvfleet"]["hit_rate"] > 0.3 and runs["prefix_tree"]["hit_rate"] > 0.3, layout
    assert report["requests"] == 40


def test_bound_counts_each_request_s_longest_prefix_shared_with_an_earlier_one():
    # 3 requests of 2 hash blocks (scale 16: 32 tokens each, two 16-token blocks): the second
    # shares the first's first block, the third all of the second's
    rows = [
        TraceRow(0.0, 1024, 8, (1, 2)),
        TraceRow(1.0, 1024, 8, (1, 3)),
        TraceRow(2.0, 1024, 8, (1, 3)),
    ]
    trace = build_trace(rows, 1, 1.0, 16)
    best = trace_replay.bound(trace, 0.0, 1000.0)
    # cached tokens 0, 32 and 63 (at most n - 1) of 64 each; uncached 64, 32, 1 at 1000 tokens/s
    assert best["hit_rate"] == pytest.approx(95 / 192, abs=1e-4)
    assert best["ttft_p50_s"] == pytest.approx(0.032)
    assert trace_replay.bound(trace, 0.5, 1000.0)["hit_rate"] == pytest.approx(95 / 128, abs=1e-4)


def test_a_host_tier_keeps_what_the_device_evicts(tmp_path: Path, capsys):
    # 24 families of 8 hash blocks, cycled 3 times: 2 workers' device pools (166 blocks each) hold
    # about 5 families each, their host tiers (4x) all of them, so the host layout hits where the
    # device-only one misses
    path = tmp_path / "trace.jsonl"
    with path.open("w") as f:
        for i in range(72):
            ids = [100 * (i % 24) + k for k in range(8)] + [10_000 + i]
            f.write(json.dumps({"timestamp": 300 * i, "input_length": 9 * 512, "output_length": 16, "hash_ids": ids}))
            f.write("\n")
    argv = ["--trace", str(path), "--scale", "16", "--workers", "2", "--warmup", "0.34", "--kv-ratio", "0.05"]
    report = run_replay(
        capsys, [*argv, "--layouts", "gemma_swa", "gemma_swa_host", "--policies", "kvfleet", "prefix_tree"]
    )
    device, host = report["runs"]["gemma_swa/W=2"], report["runs"]["gemma_swa_host/W=2"]
    for policy in ("kvfleet", "prefix_tree"):
        assert host[policy]["hit_rate"] > device[policy]["hit_rate"] + 0.2, policy
    assert host["kvfleet"]["false_hit_share"] == 0.0


def test_tokens_are_deterministic_per_hash_id_and_scale():
    assert block_tokens(7, 8) == block_tokens(7, 8)
    assert block_tokens(7, 8) != block_tokens(8, 8)
    assert len(block_tokens(7, 16)) == 32


def test_window_and_sizing(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"timestamp": t, "input_length": 700, "output_length": 16, "hash_ids": [1, 2]})
            for t in (0, 1000, 2000, 3000)
        )
    )
    rows = load_requests(path, start_s=1.0, window_s=2.0)
    assert [r.time for r in rows] == [0.0, 1.0]
    trace = build_trace(rows, workers=2, ratio=0.5, scale=8)
    assert [len(p) for p in trace.prefixes] == [700 // 8] * 2
    assert trace.prefixes[0][:64] == block_tokens(1, 8)


SHARED = trace_replay.default_trace()


@pytest.mark.skipif(not SHARED.exists(), reason=f"no shared trace at {SHARED}")
def test_a_slice_of_the_shared_trace(capsys):
    report = run_replay(capsys, ["--window-s", "15", "--workers", "4", "--scale", "16"])
    check_report(report, [4])
    assert report["requests"] > 20

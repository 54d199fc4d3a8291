"""``kvfleet_testing.workloads.hit_rate_bound``: the unbounded-cache hit rate the cluster benchmark reports
beside every policy's (the ceiling no router can pass on that prompt order)."""

from __future__ import annotations

from kvfleet_testing.workloads import hit_rate_bound


def test_first_request_of_a_prefix_never_hits_and_repeats_hit_whole_aligned_steps():
    shared = list(range(100, 140))  # 40 tokens
    prompts = [[*shared, 1, 2], [*shared[:37], 3, 4, 5], [9] * 20]
    # second prompt shares 37 tokens with the first: 32 of them in whole 16-token steps
    assert hit_rate_bound(prompts, 16) == 32 / (42 + 40 + 20)
    assert hit_rate_bound(prompts, 4) == 36 / (42 + 40 + 20)


def test_an_identical_prompt_hits_at_most_its_length_minus_one():
    prompt = list(range(33))
    assert hit_rate_bound([prompt, list(prompt)], 1) == 32 / 66
    assert hit_rate_bound([prompt, list(prompt)], 16) == 32 / 66


def test_the_longest_earlier_match_counts_not_the_latest():
    base = list(range(64))
    prompts = [base, base[:16] + [999] * 48, base[:48] + [7] * 16]
    assert hit_rate_bound(prompts, 16) == (16 + 48) / 192
    assert hit_rate_bound([], 16) == 0.0

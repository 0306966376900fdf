"""Routing policies: exact choices for affinity, imbalance, eviction, removal and corrections."""

import random
import threading

import pytest

from radixserve.router.routing.policy import (
    CacheAwarePolicy,
    Decision,
    NoReplicaAvailable,
    PolicyConfig,
    ReplicaLoad,
    make_policy,
)
from radixserve.workers.protocol import ReplicaStats

SYSTEM = list(range(10_000, 10_400))  # a 400-token shared system prompt


def prompt(tail_start, n=20, system=SYSTEM):
    return system + list(range(tail_start, tail_start + n))


def idle(*ids):
    return [ReplicaLoad(r) for r in ids]


def test_defaults_follow_sglang_router():
    cfg = PolicyConfig()
    assert (cfg.policy, cfg.cache_threshold, cfg.balance_abs_threshold) == ("cache_aware", 0.3, 64)
    assert cfg.balance_rel_threshold == 1.5
    assert (cfg.min_match_tokens, cfg.load_cost_tokens) == (64, 64)


QUESTIONS = [
    "What is 2+2?",
    "Name a color.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "How far is the Moon?",
    "Translate 'cat' to French.",
    "Give me a prime number.",
    "Who wrote Hamlet?",
    "List three fruits.",
    "Is water wet?",
    "Define entropy briefly.",
    "Spell 'necessary'.",
    "Count to five.",
    "Can penguins fly?",
    "Suggest a dog name.",
    "Explain recursion in one line.",
]


@pytest.fixture(scope="module")
def chat_prompts():
    """The 16 questions as SmolLM2's chat template renders them: they share only its header."""
    from transformers import AutoTokenizer

    from tests.tiny_models import smollm2_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]  # as the ingress encodes


def common_prefix_len(prompts):
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def test_short_chat_prompts_sharing_only_the_template_header_spread(chat_prompts):
    header = common_prefix_len(chat_prompts)
    assert header == 24 and all(30 <= len(p) <= 45 for p in chat_prompts)
    # SGLang's rule alone: the header is a 24 / ~35 match (> 0.3), so the burst piles onto "a".
    sglang = make_policy("cache_aware", min_match_tokens=0, load_cost_tokens=0)
    burst = [sglang.route(p, sglang.loads(["a", "b"])) for p in chat_prompts]
    assert [d.replica_id for d in burst] == ["a"] * 16
    assert [d.reason for d in burst] == ["cache_miss"] + ["cache_hit"] * 15
    # The defaults: a 24-token match never counts, so each request goes to the least loaded
    # replica (ties: the one claiming fewer tokens), and every pair splits: 8 / 8.
    policy = make_policy("cache_aware")
    burst = [policy.route(p, policy.loads(["a", "b"])) for p in chat_prompts]
    chosen = [d.replica_id for d in burst]
    assert chosen[:2] == ["a", "b"]
    assert all({chosen[k], chosen[k + 1]} == {"a", "b"} for k in range(0, 16, 2))
    assert [d.reason for d in burst] == ["cache_miss"] * 16
    assert [d.matched_tokens for d in burst] == [0, 0] + [header] * 14  # seen, and ignored
    assert policy.snapshot()["in_flight"] == {"a": 8, "b": 8}


def test_a_match_counts_from_min_match_tokens_on():
    policy = make_policy("cache_aware", min_match_tokens=64)
    policy.on_dispatch(list(range(64)), "a")
    policy.on_complete("a", list(range(64)))
    short = list(range(63)) + [999] * 10  # 63 / 73 > 0.3, but 63 < 64 tokens
    assert policy.choose(short, idle("a", "b")) == Decision("b", 0, "cache_miss")
    enough = list(range(64)) + [999] * 10
    assert policy.choose(enough, idle("a", "b")) == Decision("a", 64, "cache_hit")


def test_each_request_of_extra_load_costs_load_cost_tokens_of_match():
    policy = make_policy("cache_aware", load_cost_tokens=50)
    policy.on_dispatch(SYSTEM[:200], "a")
    policy.on_complete("a", SYSTEM[:200])
    p = prompt(1)  # matches 200 tokens on "a"
    # a carries 4 requests more than b: 200 >= 50 * 4, the match pays for them.
    paid = [ReplicaLoad("a", in_flight=5), ReplicaLoad("b", in_flight=1)]
    assert policy.choose(p, paid) == Decision("a", 200, "cache_hit")
    # 5 more: 200 < 250, the least loaded takes it (and will hold the prefix from now on).
    unpaid = [ReplicaLoad("a", in_flight=6), ReplicaLoad("b", in_flight=1)]
    assert policy.choose(p, unpaid) == Decision("b", 0, "cache_miss")
    # Two matching replicas: the best match net of its load wins, not the longest match.
    policy.on_dispatch(SYSTEM[:150], "c")
    three = [ReplicaLoad("a", in_flight=3), ReplicaLoad("b", 2), ReplicaLoad("c", in_flight=1)]
    assert policy.choose(p, three) == Decision("c", 150, "cache_hit")  # 150 - 50 > 200 - 150
    # A hot prefix spreads once its replica is loaded enough: a burst of equal prompts.
    burst = make_policy("cache_aware", load_cost_tokens=50)
    burst.on_dispatch(SYSTEM[:200], "a")
    burst.on_complete("a", SYSTEM[:200])
    tails = [list(range(90_000 + 100 * i, 90_000 + 100 * i + 20)) for i in range(11)]
    chosen = [burst.route(SYSTEM[:200] + t, burst.loads(["a", "b"])).replica_id for t in tails]
    # a takes 5 (loads 0..4: 200 >= 50 * 4); then b, which holds the prefix from then on, wins
    # on net score until the loads are equal again (5 / 5: ties to the lowest id).
    assert chosen == ["a"] * 5 + ["b"] * 5 + ["a"]


def test_shared_prefix_sticks_to_one_replica_and_new_prefixes_spread():
    policy = make_policy("cache_aware")
    first = policy.route(prompt(1), policy.loads(["a", "b"]))
    assert first == Decision("a", 0, "cache_miss")  # all equal: the lowest id
    policy.on_complete("a", prompt(1), [7, 8])
    other = list(range(50_000, 50_300))
    # Equal load again: the replica claiming fewer tokens takes the new prefix.
    assert policy.route(other, policy.loads(["a", "b"])) == Decision("b", 0, "cache_miss")
    for i in range(5):
        decision = policy.route(prompt(100 * (i + 2)), policy.loads(["a", "b"]))
        assert decision == Decision("a", 400, "cache_hit")
    # Multi-turn: the next turn extends prompt + output, which on_complete recorded.
    turn2 = prompt(1) + [7, 8] + [3, 3, 3]
    assert policy.choose(turn2, policy.loads(["a", "b"])) == Decision("a", 422, "cache_hit")


def test_new_prefix_goes_to_the_least_loaded():
    policy = make_policy("cache_aware")
    loads = [ReplicaLoad("a", in_flight=3), ReplicaLoad("b", in_flight=1), ReplicaLoad("c", 2)]
    assert policy.choose(prompt(1), loads) == Decision("b", 0, "cache_miss")


def test_match_rate_must_exceed_the_cache_threshold():
    # The rate rule alone: no minimum length, and load never outweighs a match.
    policy = make_policy("cache_aware", cache_threshold=0.5, min_match_tokens=0, load_cost_tokens=0)
    policy.on_dispatch(list(range(100)), "a")
    loads = [ReplicaLoad("a", in_flight=2), ReplicaLoad("b", in_flight=1)]
    at_threshold = list(range(50)) + list(range(900, 950))  # 50 / 100 is not > 0.5
    assert policy.choose(at_threshold, loads) == Decision("b", 0, "cache_miss")
    above = list(range(51)) + list(range(900, 949))
    assert policy.choose(above, loads) == Decision("a", 51, "cache_hit")


def test_imbalance_falls_back_to_the_least_loaded_despite_a_match():
    # SGLang's thresholds alone (abs 64, rel 1.5): load weighs nothing below them.
    policy = make_policy("cache_aware", load_cost_tokens=0)
    policy.on_dispatch(prompt(1), "a")
    p = prompt(500)
    busy = [ReplicaLoad("a", in_flight=100), ReplicaLoad("b", in_flight=30)]
    assert policy.choose(p, busy) == Decision("b", 0, "imbalance")
    # Gap of 60 <= 64: balanced, affinity wins.
    near = [ReplicaLoad("a", in_flight=90), ReplicaLoad("b", in_flight=30)]
    assert policy.choose(p, near) == Decision("a", 400, "cache_hit")
    # Gap of 70 > 64 but 270 <= 200 * 1.5: still balanced.
    relative = [ReplicaLoad("a", running=200, queued=70), ReplicaLoad("b", in_flight=200)]
    assert policy.choose(p, relative) == Decision("a", 400, "cache_hit")
    assert policy.snapshot()["imbalance_fallbacks"] == 1


def test_imbalance_prefers_the_best_match_among_the_least_loaded():
    policy = make_policy("cache_aware")
    policy.on_dispatch(prompt(1), "a")
    policy.on_dispatch(SYSTEM[:100], "b")
    policy.on_dispatch(list(range(70_000, 70_500)), "c")  # c claims more than d
    loads = [ReplicaLoad("a", in_flight=100), ReplicaLoad("b", 0), ReplicaLoad("c", 0), ReplicaLoad("d", 0)]
    assert policy.choose(prompt(9), loads) == Decision("b", 100, "imbalance")
    # No least-loaded replica matches: fewest claimed tokens wins (d claims none).
    assert policy.choose([5, 5, 5], loads) == Decision("d", 0, "imbalance")


def test_ties_break_deterministically_whatever_the_candidate_order():
    for order in (["c", "a", "b"], ["b", "c", "a"]):
        policy = make_policy("cache_aware")
        assert policy.route([1, 2, 3], idle(*order)).replica_id == "a"
        policy.on_complete("a", [1, 2, 3])
        assert policy.route([4, 5, 6], idle(*order)).replica_id == "b"
        policy.on_complete("b", [4, 5, 6])
        policy.on_dispatch(SYSTEM, "b")
        policy.on_dispatch(SYSTEM, "c")
        # Equal match and load: the lowest id among the longest matches.
        assert policy.choose(prompt(1), idle(*order)) == Decision("b", 400, "cache_hit")


def test_evicted_prefix_no_longer_routes_to_its_old_replica():
    policy = make_policy("cache_aware", max_tokens_per_replica=500)
    policy.on_dispatch(prompt(1), "a")  # 420 tokens
    policy.on_dispatch(list(range(80_000, 80_200)), "a")  # 620 > 500: prompt(1) evicted
    loads = [ReplicaLoad("a", in_flight=1), ReplicaLoad("b", in_flight=0)]
    assert policy.choose(prompt(1), loads) == Decision("b", 0, "cache_miss")
    assert policy.choose(list(range(80_000, 80_300)), loads) == Decision("a", 200, "cache_hit")
    snap = policy.snapshot()
    assert (snap["tree_tokens"], snap["tree_nodes"]) == (200, 1)


def test_removed_replica_gets_no_more_requests_and_late_completions_are_ignored():
    policy = make_policy("cache_aware")
    policy.route(prompt(1), idle("a", "b"))
    assert policy.route(prompt(2), policy.loads(["a", "b"])).replica_id == "a"
    policy.on_replica_removed("a")
    assert policy.route(prompt(3), policy.loads(["b", "c"])) == Decision("b", 0, "cache_miss")
    policy.on_complete("a", prompt(1), [1, 2])  # the dead replica's stream ending
    snap = policy.snapshot()
    assert snap["in_flight"] == {"b": 1}
    assert snap["tree_tokens_by_replica"] == {"b": 420}
    assert policy.choose(prompt(4), idle("b", "c")) == Decision("b", 400, "cache_hit")


def test_replica_events_and_summaries_correct_the_tree():
    policy = make_policy("cache_aware")
    policy.on_dispatch(prompt(1), "a")
    policy.on_replica_events("a", evicted=[SYSTEM[:1]])  # a evicted everything of it
    assert policy.choose(prompt(2), idle("a", "b")) == Decision("a", 0, "cache_miss")
    assert policy.snapshot()["tree_tokens"] == 0
    policy.on_replica_events("b", inserted=[prompt(1)])  # b cached it (another ingress sent it)
    assert policy.choose(prompt(2), idle("a", "b")) == Decision("b", 400, "cache_hit")
    mark = policy.sync_point()
    policy.on_dispatch(list(range(60_000, 60_100)), "b")  # routed while the report travels
    policy.on_replica_summary("b", [(None, SYSTEM[:300])], keep_newer_than=mark)
    assert policy.choose(prompt(2), idle("a", "b")) == Decision("b", 300, "cache_hit")
    assert policy.choose(list(range(60_000, 60_100)), idle("a", "b")).replica_id == "b"


def test_a_prefix_in_a_lower_cache_tier_counts_below_the_device_and_above_a_miss():
    policy = make_policy("cache_aware", lower_tier_weight=0.5)
    # a holds the system prompt in its host tier only; b on its device, but only 200 tokens.
    policy.on_replica_summary("a", [], lower=[(None, prompt(1))])
    assert policy.choose(prompt(2), idle("a", "c")) == Decision("a", 200, "cache_hit")
    policy.on_replica_summary("b", [(None, SYSTEM[:300])])
    assert policy.choose(prompt(2), idle("a", "b")) == Decision("b", 300, "cache_hit")
    # a's device holds the first 300 as well: 300 + half of the 100 beyond it in its host tier.
    policy.on_replica_summary("a", [(None, SYSTEM[:300])], lower=[(None, prompt(1))])
    assert policy.choose(prompt(2), idle("a", "b")) == Decision("a", 350, "cache_hit")
    assert policy.snapshot()["lower_tree_tokens"] == 420
    policy.on_replica_removed("a")
    assert policy.snapshot()["lower_tree_tokens"] == 0
    with pytest.raises(ValueError, match="lower_tier_weight"):
        PolicyConfig(lower_tier_weight=1.5)


def test_replica_capacity_bounds_what_the_tree_believes():
    policy = make_policy("cache_aware")
    policy.on_dispatch(prompt(1), "a")
    policy.set_replica_capacity("a", 100)  # its KV pool holds 100 tokens: the claim goes
    assert policy.snapshot()["tree_tokens_by_replica"] == {}


def test_round_robin_cycles_in_candidate_order():
    policy = make_policy("round_robin")
    chosen = [policy.route([1], idle("a", "b", "c")).replica_id for _ in range(7)]
    assert chosen == ["a", "b", "c", "a", "b", "c", "a"]
    assert policy.snapshot()["in_flight"] == {"a": 3, "b": 2, "c": 2}


def test_power_of_two_never_picks_the_most_loaded_and_is_reproducible():
    loads = [ReplicaLoad("a", in_flight=5), ReplicaLoad("b", 0), ReplicaLoad("c", in_flight=9)]
    runs = []
    for _ in range(2):
        policy = make_policy("power_of_two", seed=1234)
        runs.append([policy.choose([1], loads).replica_id for _ in range(300)])
    assert runs[0] == runs[1]
    assert "c" not in runs[0] and {"a", "b"} == set(runs[0])
    # "a" wins only when drawn with "c": about a third of the time.
    assert 60 < runs[0].count("a") < 140
    two = make_policy("power_of_two", seed=5)
    pair = [ReplicaLoad("a", in_flight=1), ReplicaLoad("b", in_flight=0)]
    assert {two.choose([1], pair).replica_id for _ in range(50)} == {"b"}


def test_random_is_reproducible_with_a_seed():
    policy = make_policy("random", seed=3)
    chosen = [policy.choose([1], idle("a", "b", "c")).replica_id for _ in range(60)]
    again = make_policy("random", seed=3)
    assert chosen == [again.choose([1], idle("a", "b", "c")).replica_id for _ in range(60)]
    assert set(chosen) == {"a", "b", "c"}
    assert again.choose([1], idle("a")) == Decision("a", 0, "random")


def test_snapshot_counts_hits_misses_fallbacks_and_in_flight():
    policy = make_policy("cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.0)
    policy.route(prompt(1), policy.loads(["a", "b"]))  # miss -> a
    policy.route(prompt(2), policy.loads(["a", "b"]))  # hit -> a
    policy.route(prompt(3), policy.loads(["a", "b"]))  # hit -> a (gap 2 is not > 2)
    policy.route(prompt(4), policy.loads(["a", "b"]))  # gap 3: imbalance -> b
    policy.on_complete("a", prompt(1))
    snap = policy.snapshot()
    assert snap == {
        "policy": "cache_aware",
        "requests_total": 4,
        "prefix_hits": 2,
        "prefix_misses": 1,
        "imbalance_fallbacks": 1,
        "matched_tokens_total": 800,
        "tree_tokens": 480,
        "tree_nodes": 5,
        "tree_tokens_by_replica": {"a": 460, "b": 420},
        "lower_tree_tokens": 0,
        "in_flight": {"a": 2, "b": 1},
        "in_flight_tokens": {"a": 840, "b": 420},
    }


def test_loads_combine_own_in_flight_with_replica_reports():
    policy = make_policy("round_robin")
    policy.on_dispatch([1, 2], "a")
    reports = {"b": ReplicaStats(replica_id="b", running=4, queued=3)}
    loads = policy.loads(["a", "b"], reports)
    assert loads == [ReplicaLoad("a", in_flight=1), ReplicaLoad("b", running=4, queued=3)]
    assert [r.load for r in loads] == [1, 7]
    with_kv = ReplicaStats(replica_id="b", kv_total=1000, kv_free=300, kv_evictable=200)
    assert policy.loads(["b"], {"b": with_kv})[0].kv_room == 500


def test_kv_aware_leaves_out_replicas_without_room_for_the_prompt():
    policy = make_policy("kv_aware")
    long = list(range(600))
    # b is less loaded but its KV cannot take the prompt: a, which can, gets it.
    cands = [ReplicaLoad("a", running=3, kv_room=5000), ReplicaLoad("b", running=0, kv_room=400)]
    assert policy.choose(long, cands).replica_id == "a"
    # Both have room: the less loaded; equal loads go to the one with more room.
    cands = [ReplicaLoad("a", running=3, kv_room=5000), ReplicaLoad("b", running=0, kv_room=900)]
    assert policy.choose(long, cands).replica_id == "b"
    cands = [ReplicaLoad("a", running=1, kv_room=900), ReplicaLoad("b", running=1, kv_room=5000)]
    assert policy.choose(long, cands) == Decision("b", 0, "cache_miss")
    # None has room: the one with the most (it may free more by the time the KV comes).
    cands = [ReplicaLoad("a", kv_room=100), ReplicaLoad("b", kv_room=300)]
    assert policy.choose(long, cands) == Decision("b", 0, "kv_room")
    # No report yet: room is unknown, not missing.
    assert policy.choose(long, [ReplicaLoad("a"), ReplicaLoad("b", running=2)]).replica_id == "a"


def test_kv_aware_sends_a_follow_up_turn_where_its_conversation_is():
    """The decode replica holding the first turn needs only the new pages: it gets the second
    turn even with a little less room, as long as the prefix it holds covers the gap."""
    policy = make_policy("kv_aware")
    turn1 = prompt(50_000, n=200)
    policy.on_dispatch(turn1, "b")
    policy.on_complete("b", turn1)
    turn2 = turn1 + list(range(60_000, 60_100))
    cands = [ReplicaLoad("a", kv_room=5000), ReplicaLoad("b", kv_room=200)]
    assert policy.choose(turn2, cands) == Decision("b", len(turn1), "cache_hit")
    # Room is counted against what the replica must newly hold: 100 tokens do not fit in 50.
    cands = [ReplicaLoad("a", kv_room=5000), ReplicaLoad("b", kv_room=50)]
    assert policy.choose(turn2, cands).replica_id == "a"


def test_namespaces_neither_attract_nor_see_each_other():
    policy = make_policy("cache_aware")
    assert policy.route(prompt(1), idle("a", "b"), namespace="acme") == Decision("a", 0, "cache_miss")
    policy.on_complete("a", prompt(1), [5, 6], namespace="acme")
    # The same prompt from another tenant, or from the shared namespace, matches nothing there:
    # it goes where a new prefix goes (b claims fewer tokens).
    assert policy.choose(prompt(1), idle("a", "b"), namespace="globex") == Decision("b", 0, "cache_miss")
    assert policy.choose(prompt(1), idle("a", "b")) == Decision("b", 0, "cache_miss")
    assert policy.choose(prompt(2), idle("a", "b"), namespace="acme") == Decision("a", 400, "cache_hit")
    policy.route(prompt(1), idle("a", "b"), namespace="globex")
    snap = policy.snapshot()
    assert snap["tree_tokens_by_replica"] == {"a": 422, "b": 420}
    assert snap["tree_tokens"] == 842  # equal tokens in two namespaces are stored twice
    # A replica's summary corrects every namespace it names, and only its own claims.
    policy.on_replica_summary("a", [("acme", SYSTEM[:300]), (None, SYSTEM[:200])])
    assert policy.choose(prompt(3), idle("a", "b"), namespace="acme") == Decision("a", 300, "cache_hit")
    assert policy.choose(prompt(3), idle("a", "b")) == Decision("a", 200, "cache_hit")
    assert policy.choose(prompt(3), idle("a", "b"), namespace="globex") == Decision("b", 400, "cache_hit")


def test_bad_names_config_and_empty_candidates_are_rejected():
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("fastest")
    with pytest.raises(ValueError):
        make_policy("cache_aware", cache_threshold=1.5)
    with pytest.raises(ValueError):
        make_policy("cache_aware", balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="min_match_tokens"):
        make_policy("cache_aware", load_cost_tokens=-1)
    with pytest.raises(NoReplicaAvailable):
        make_policy("cache_aware").route([1], [])
    assert isinstance(make_policy(policy="cache_aware"), CacheAwarePolicy)


def test_concurrent_routing_keeps_counts_consistent():
    policy = make_policy("cache_aware", max_tree_tokens=20_000)
    replicas = ["a", "b", "c"]

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(300):
            tokens = prompt(rng.randrange(5) * 1000, 30, SYSTEM[: rng.randrange(1, 400)])
            decision = policy.route(tokens, policy.loads(replicas))
            policy.on_complete(decision.replica_id, tokens, [rng.randrange(9)])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = policy.snapshot()
    assert snap["requests_total"] == 1200
    assert snap["prefix_hits"] + snap["prefix_misses"] + snap["imbalance_fallbacks"] == 1200
    assert set(snap["in_flight"].values()) == {0} and set(snap["in_flight_tokens"].values()) == {0}
    assert snap["tree_tokens"] <= 20_000
    policy._tree.check_integrity()


def test_a_replica_holding_the_adapter_wins_a_miss_within_lora_affinity_load():
    from radixserve.workers.protocol import LoRARef

    policy = CacheAwarePolicy(PolicyConfig(lora_affinity_load=2))
    ns = LoRARef("coder", "/adapters/coder").namespace(None)
    prompt = list(range(100))

    def pick(a_load: int, b_load: int, namespace=ns) -> str:
        a = ReplicaLoad("a", in_flight=a_load, adapters=frozenset({"coder"}))
        b = ReplicaLoad("b", in_flight=b_load, adapters=frozenset({"writer"}))
        return policy.choose(prompt, [a, b], namespace).replica_id

    assert pick(1, 0) == "a"  # one request more, and no read of the adapter
    assert pick(2, 0) == "a"  # a tie: equal claims, then the lower id
    assert pick(3, 0) == "b"  # past lora_affinity_load the load wins
    assert pick(1, 0, namespace=None) == "b"  # the base model: load alone
    assert pick(1, 0, namespace=LoRARef("writer", "/w").namespace("acme")) == "b"
    # The adapter's reports reach the candidates through ReplicaStats.lora_loaded.
    loads = policy.loads(["a"], {"a": ReplicaStats(lora_loaded=["coder"])})
    assert loads[0].adapters == frozenset({"coder"})

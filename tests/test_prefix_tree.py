"""PrefixTree: exact matches, eviction orders, corrections, and a randomized reference check."""

import random

import pytest

from radixserve.router.routing.prefix_tree import PrefixTree, common_prefix_len


def seq(start, n):
    return list(range(start, start + n))


def test_common_prefix_len_finds_first_mismatch_in_long_runs():
    key = tuple(range(5000))
    other = list(key)
    other[4321] = -1
    assert common_prefix_len(key, tuple(other), 0) == 4321
    assert common_prefix_len(key, key, 0) == 5000
    assert common_prefix_len(key, (7,) + key[:10], 1) == 10  # tokens end first
    assert common_prefix_len(key[:3], tuple(range(10)), 0) == 3  # key ends first
    assert common_prefix_len(key, (0, 1, 9), 0) == 2


def test_match_reports_longest_claimed_prefix_per_replica():
    tree = PrefixTree()
    system = seq(1000, 50)
    tree.insert(system + seq(1, 10), "a")
    tree.insert(system + seq(500, 20), "b")
    assert tree.num_nodes == 3 and tree.total_tokens == 80
    assert tree.match(system + seq(1, 10)) == {"a": 60, "b": 50}
    assert tree.match(system + seq(1, 4) + [9999]) == {"a": 54, "b": 50}
    assert tree.match(system[:7]) == {"a": 7, "b": 7}
    assert tree.match([42]) == {}
    assert tree.match([]) == {}
    assert tree.replica_tokens("a") == 60 and tree.replica_tokens("b") == 70
    tree.check_integrity()


def test_per_replica_budget_evicts_least_recently_used_leaf():
    tree = PrefixTree(max_tokens_per_replica=250)
    a, b, c = seq(0, 100), seq(1000, 100), seq(2000, 100)
    tree.insert(a, "r")
    tree.insert(b, "r")
    tree.insert(a, "r")  # touch: b is now the least recently used
    tree.insert(c, "r")
    assert tree.match(a) == {"r": 100}
    assert tree.match(b) == {}
    assert tree.match(c) == {"r": 100}
    assert tree.replica_tokens("r") == 200 and tree.total_tokens == 200
    tree.check_integrity()


def test_eviction_drops_only_the_leaf_and_keeps_the_shared_prefix():
    tree = PrefixTree(max_tokens_per_replica=140)
    system = seq(0, 50)
    tree.insert(system + seq(100, 50), "r")
    tree.insert(system + seq(200, 50), "r")  # 150 > 140: the first branch's leaf goes
    assert tree.match(system + seq(100, 50)) == {"r": 50}
    assert tree.match(system + seq(200, 50)) == {"r": 100}
    assert tree.replica_tokens("r") == 100 and tree.num_nodes == 2
    tree.check_integrity()


def test_a_parent_is_evicted_once_its_children_are_gone():
    tree = PrefixTree()
    system = seq(0, 50)
    tree.insert(system + seq(100, 50), "r")
    tree.insert(system + seq(200, 50), "r")
    tree.insert(seq(900, 45), "r")
    tree.set_replica_budget("r", 60)  # 195 -> leaves in LRU order: branch 100, branch 200, system
    assert tree.match(system + seq(200, 50)) == {}
    assert tree.match(seq(900, 45)) == {"r": 45}
    assert tree.total_tokens == 45 and tree.num_nodes == 1
    tree.check_integrity()


def test_replica_eviction_keeps_nodes_other_replicas_claim():
    tree = PrefixTree()
    tree.set_replica_budget("a", 100)
    tree.insert(seq(0, 80), "a")
    tree.insert(seq(0, 80), "b")
    tree.insert(seq(500, 60), "a")  # a over budget: its LRU leaf (seq(0, 80)) goes
    assert tree.match(seq(0, 80)) == {"b": 80}
    assert tree.match(seq(500, 60)) == {"a": 60}
    assert tree.total_tokens == 140
    tree.check_integrity()


def test_total_budget_evicts_the_oldest_leaf_claim_of_any_replica():
    tree = PrefixTree(max_tokens=300)
    tree.insert(seq(0, 100), "r1")
    tree.insert(seq(1000, 100), "r2")
    tree.insert(seq(2000, 100), "r1")
    tree.insert(seq(1000, 100), "r2")  # touch
    tree.insert(seq(3000, 100), "r2")  # 400 > 300: r1's seq(0, 100) is the oldest
    assert tree.match(seq(0, 100)) == {}
    assert tree.replicas() == ["r1", "r2"]
    assert tree.total_tokens == 300
    tree.insert(seq(4000, 100), "r1")  # next oldest: r1's seq(2000, 100)
    assert tree.match(seq(2000, 100)) == {}
    assert tree.match(seq(1000, 100)) == {"r2": 100}
    tree.check_integrity()


def test_insert_longer_than_budget_is_truncated():
    tree = PrefixTree(max_tokens=1000, max_tokens_per_replica=200)
    assert tree.insert(seq(0, 500), "r") == 200
    assert tree.match(seq(0, 500)) == {"r": 200}
    tree.set_replica_budget("r", 50)  # shrinking a budget evicts at once (whole leaves)
    assert tree.match(seq(0, 500)) == {}
    assert tree.total_tokens == 0 and tree.num_nodes == 0
    tree.check_integrity()


def test_remove_replica_deletes_its_claims_and_orphan_nodes():
    tree = PrefixTree()
    system = seq(0, 40)
    tree.insert(system + seq(100, 10), "a")
    tree.insert(system + seq(200, 10), "b")
    tree.remove_replica("a")
    assert tree.match(system + seq(100, 10)) == {"b": 40}
    assert tree.replicas() == ["b"]
    assert tree.total_tokens == 50 and tree.num_nodes == 2
    tree.check_integrity()


def test_evict_prefix_cuts_the_claim_before_the_last_reported_token():
    tree = PrefixTree()
    tokens = seq(0, 100)
    tree.insert(tokens, "a")
    tree.insert(tokens, "b")
    tree.evict_prefix(tokens[:61], "a")  # a evicted the node starting at position 60
    assert tree.match(tokens) == {"a": 60, "b": 100}
    tree.evict_prefix(seq(0, 30) + [777], "b")  # a path the tree does not know: ignored
    tree.evict_prefix(tokens[:61], "zzz")  # an unknown replica: ignored
    assert tree.match(tokens) == {"a": 60, "b": 100}
    tree.evict_prefix(tokens[:1], "a")
    assert tree.match(tokens) == {"b": 100}
    tree.check_integrity()


def test_apply_replica_events_evicts_then_inserts():
    tree = PrefixTree()
    old, new = seq(0, 50), seq(900, 30)
    tree.insert(old, "a")
    tree.apply_replica_events("a", inserted=[new, old[:20]], evicted=[old[:11]])
    assert tree.match(old) == {"a": 20}  # cut to 10, then re-inserted up to 20
    assert tree.match(new) == {"a": 30}
    tree.check_integrity()


def test_sync_replica_replaces_claims_in_lru_order_and_keeps_newer_routes():
    tree = PrefixTree(max_tokens_per_replica=300)
    tree.insert(seq(0, 100), "a")  # router's belief, which the replica no longer holds
    mark = tree.clock
    tree.insert(seq(5000, 100), "a")  # routed after the report was requested
    tree.sync_replica("a", [(None, seq(1000, 100)), (None, seq(2000, 50))], keep_newer_than=mark)
    assert tree.match(seq(0, 100)) == {}
    assert tree.match(seq(5000, 100)) == {"a": 100}
    assert tree.match(seq(1000, 100)) == {"a": 100}
    assert tree.match(seq(2000, 50)) == {"a": 50}
    tree.insert(seq(3000, 100), "a")  # 350 > 300: the oldest is the routed one, stamped first
    assert tree.match(seq(5000, 100)) == {}
    tree.sync_replica("a", [(None, seq(1000, 10))])  # without a mark, the report is the whole truth
    assert tree.match(seq(1000, 100)) == {"a": 10} and tree.replica_tokens("a") == 10
    tree.check_integrity()


def test_namespaces_have_their_own_roots_and_share_the_replica_budget():
    tree = PrefixTree(max_tokens_per_replica=250)
    tree.insert(seq(0, 100), "r", "acme")
    tree.insert(seq(0, 100), "r", "globex")
    assert tree.match(seq(0, 100), "acme") == {"r": 100}
    assert tree.match(seq(0, 100)) == {} and tree.match(seq(0, 100), "initech") == {}
    assert tree.total_tokens == 200 and tree.num_nodes == 2 and tree.num_namespaces == 2
    tree.insert(seq(500, 100), "r")  # 300 > 250 for r in all namespaces: acme's leaf is the LRU
    assert tree.match(seq(0, 100), "acme") == {}
    assert tree.match(seq(0, 100), "globex") == {"r": 100}
    assert tree.num_namespaces == 2  # acme's root went with its last node
    tree.evict_prefix(seq(0, 1), "r", "acme")  # a namespace the tree no longer has: ignored
    tree.evict_prefix(seq(0, 1), "r", "globex")
    assert tree.match(seq(0, 100), "globex") == {} and tree.num_namespaces == 1
    assert tree.replica_tokens("r") == 100
    tree.check_integrity()


def test_many_touches_keep_the_lazy_heap_bounded():
    tree = PrefixTree()
    for i in range(2000):
        tree.insert(seq(0, 30) + [i % 7], "r")
    assert len(tree._heaps["r"]) <= 2 * len(tree._claims["r"]) + 64
    tree.check_integrity()


def reference_match(held, tokens, namespace):
    result = {}
    for (replica, ns), sequences in held.items():
        best = max((common_prefix_len(tuple(s), tuple(tokens), 0) for s in sequences), default=0)
        if ns == namespace and best:
            result[replica] = best
    return result


def test_randomized_operations_agree_with_a_brute_force_model():
    rng = random.Random(7)
    tree = PrefixTree()  # no budgets: the model is exact
    spaces = (None, "t1", "t2")
    held = {(r, ns): [] for r in "abc" for ns in spaces}

    def rand_seq():
        return [rng.randrange(3) for _ in range(rng.randrange(1, 12))]

    for step in range(2000):
        op, replica, ns, tokens = rng.random(), rng.choice("abc"), rng.choice(spaces), rand_seq()
        if op < 0.55:
            tree.insert(tokens, replica, ns)
            held[replica, ns].append(tokens)
        elif op < 0.8:
            tree.evict_prefix(tokens, replica, ns)
            n = len(tokens)
            held[replica, ns] = [s[: n - 1] if s[:n] == tokens else s for s in held[replica, ns]]
        elif op < 0.9:
            summary = [(rng.choice(spaces), rand_seq()) for _ in range(rng.randrange(4))]
            tree.sync_replica(replica, summary)
            for space in spaces:
                held[replica, space] = [t for s, t in summary if s == space]
        else:
            tree.remove_replica(replica)
            for space in spaces:
                held[replica, space] = []
        probe, space = rand_seq(), rng.choice(spaces)
        assert tree.match(probe, space) == reference_match(held, probe, space), step
        if step % 50 == 0:
            tree.check_integrity()
    tree.check_integrity()


def test_long_prompts_sharing_long_prefixes_match_exactly():
    rng = random.Random(0)
    tree = PrefixTree(max_tokens=1 << 20)
    systems = [[rng.randrange(50000) for _ in range(2000)] for _ in range(20)]
    prompts = [s + [rng.randrange(50000) for _ in range(2000)] for s in systems for _ in range(10)]
    for i, prompt in enumerate(prompts):
        matched = tree.match(prompt)
        # The first prompt of a group is new; later ones share its 2000-token system prompt with
        # every replica that served an earlier prompt of the group.
        expected = {} if i % 10 == 0 else {f"r{j % 4}": 2000 for j in range(i - i % 10, i)}
        assert matched == expected, i
        tree.insert(prompt, f"r{i % 4}")
    tree.check_integrity()


@pytest.mark.parametrize("bad", [0, -5])
def test_rejects_a_non_positive_total_budget(bad):
    with pytest.raises(ValueError):
        PrefixTree(max_tokens=bad)

"""The cluster page's pure parts (chronoq.console.cluster): replica rows, the in-sync rule in
effect (etcd's published set, else a pull within the sync bound), the overview line."""

from chronoq.console.cluster import replica_rows, summary

NOW = 1_000_000


def pulled_within(bound_ms: int):
    """The rule without etcd reduced to its first half (a pull within the bound); the second
    (holding what was written a bound ago) is ``PrimaryNode.in_sync``'s, tested in test_replication."""
    return lambda _endpoint, _pos, seen: NOW - seen <= bound_ms


def published(endpoints: set):
    return lambda endpoint, _pos, _seen: endpoint in endpoints
REPLICAS = {"n2": ("10.0.0.2:8081", 900, NOW - 200), "n1": ("10.0.0.1:8081", 1000, NOW - 7000)}
LAGS = {"10.0.0.2:8081": (100, 1.5), "10.0.0.1:8081": (0, 0.0)}


def test_rows_carry_each_replicas_figures_sorted_by_node():
    rows = replica_rows(REPLICAS, LAGS, NOW, pulled_within(5000))
    assert [r["node_id"] for r in rows] == ["n1", "n2"]
    assert rows[1] == {"node_id": "n2", "endpoint": "10.0.0.2:8081", "position": 900, "lag_bytes": 100,
                       "lag_s": 1.5, "last_pull_ms": NOW - 200, "age_s": 0.2, "in_sync": True}


def test_in_sync_without_etcd_is_a_pull_within_the_bound_and_with_etcd_the_published_set():
    assert [r["in_sync"] for r in replica_rows(REPLICAS, LAGS, NOW, pulled_within(5000))] == [False, True]
    assert [r["in_sync"] for r in replica_rows(REPLICAS, LAGS, NOW, published({"10.0.0.1:8081"}))] == [True, False]


def test_the_overview_line_names_a_single_node():
    assert summary([], "primary", 3) == "primary, epoch 3: single node (no replicas)"
    assert summary(replica_rows(REPLICAS, LAGS, NOW, pulled_within(5000)), "primary", 0) == \
        "primary, epoch 0: 2 replica(s), 1 in sync"

"""The share-out rule of broker-wide limits (chronoq.core.fairshare)."""

from chronoq.core.fairshare import give_up_one


def test_the_connection_holding_at_least_two_more_gives_one_up():
    held = {"hog": [1, 2, 3], "mid": [1, 2], "new": []}
    assert give_up_one(held, "new") == "hog"
    assert give_up_one(held, "unknown") == "hog"  # a connection holding none yet
    assert give_up_one(held, "mid") is None  # 3 against 2: the shares would only swap
    assert give_up_one({"a": [1]}, "b") is None and give_up_one({}, "b") is None

"""Capabilities built on the broker's write and read paths: transactions (half messages, commit,
rollback, checks), staged publishes (Spark's exactly-once writes), and a message's life story
(``lifeline`` assembles it, ``lookup`` finds a message by id or key)."""

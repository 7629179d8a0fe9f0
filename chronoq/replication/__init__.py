"""Replication: a replica follows its primary's durable logs byte for byte (docs/replication.md).

``position`` what a position is and what is shipped (pure helpers and the epoch record),
``shipper`` the primary's side (answers pulls), ``follower`` the replica's side (pulls, appends,
fsyncs), ``service`` the ``chronoq.v1.Replication`` gRPC servicer both roles serve. The replica's
process (its front end, refusals, promotion) is ``chronoq.server.replica``.
"""

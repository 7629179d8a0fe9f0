"""The RocketMQ 5 protocol (``apache.rocketmq.v2``) as chronoq encodes and reads it by hand, below
every user of it (the gRPC front end, the admin service, the client): ``fields`` (the one table of
field numbers and the wire primitives), ``send``, ``receive`` and ``ack`` (one encoder per message
shape on the serving path, each held byte for byte to the generated classes by the tests), and
``status`` (chronoq's errors as the protocol's status codes)."""

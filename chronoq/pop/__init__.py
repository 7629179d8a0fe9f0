"""POP consumption (RocketMQ 5 "pop" mode): any consumer of a group may receive from any queue.

Pure core (no I/O, explicit ``now_ms``): ``names`` (topic names, properties, request rules),
``handle`` (receipt-handle codec), ``inflight`` (checkpoints, ack bitmaps, deadlines, FIFO
blocking, attempt ids). Shell: ``poplog`` (the durable CK/ACK log) and ``service``
(``PopService``, the API the gRPC shell and tests call).
"""

"""``MessagingService`` (``service``) and its RPCs grouped by job: ``send``, ``receive``, ``ack``,
``clients``; ``calls`` holds what every RPC shares (the exception boundary, request types)."""

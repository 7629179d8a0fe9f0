"""chronoq's asyncio client (``client.Client``, ``client.AdminClient``) and its HTTP/2 transport
for unary calls (``h2channel``).

``from chronoq.client import Client`` is the public import; names are resolved on first use.
"""

_PUBLIC = {"Client", "AdminClient", "OutgoingMessage", "ReceivedMessage", "SendReceipt", "ClientError"}


def __getattr__(name: str):
    if name in _PUBLIC:
        from chronoq.client import client
        return getattr(client, name)
    raise AttributeError(f"module 'chronoq.client' has no attribute {name!r}")

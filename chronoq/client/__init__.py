"""chronoq's asyncio client (``client.Client``), its HTTP/2 transport for unary calls
(``h2channel``) and the operator-side clients (``admin.AdminClient``).

``from chronoq.client import Client`` is the public import; names are resolved on first use.
"""

_PUBLIC = {"Client", "AdminClient", "OutgoingMessage", "ReceivedMessage", "SendReceipt", "ClientError", "BatchSendError"}


def __getattr__(name: str):
    if name == "AdminClient":
        from chronoq.client import admin
        return admin.AdminClient
    if name in _PUBLIC:
        from chronoq.client import client
        return getattr(client, name)
    raise AttributeError(f"module 'chronoq.client' has no attribute {name!r}")

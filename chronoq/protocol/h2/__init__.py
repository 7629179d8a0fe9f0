"""HTTP/2, sans-IO: HPACK decoding (``hpackdec``) and what the client and server share."""

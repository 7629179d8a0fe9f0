"""The ``chronoq`` command (``main.main``): serve, and the remote commands over gRPC."""

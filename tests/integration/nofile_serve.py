"""``python -m tests.integration.nofile_serve serve ...``: ``chronoq`` under a hard open-files limit
(``NOFILE_ENV``, soft and hard alike, so the broker cannot raise it), for test_open_files.py."""

from __future__ import annotations

import os
import resource

NOFILE_ENV = "CHRONOQ_TEST_NOFILE"

if __name__ == "__main__":
    limit = int(os.environ[NOFILE_ENV])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    from chronoq.cli.main import main

    main()

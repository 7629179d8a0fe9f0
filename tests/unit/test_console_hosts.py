"""With access control off the console answers only requests addressed to an IP address,
localhost or a listed name (DNS rebinding: another site's name pointed at 127.0.0.1)."""

from __future__ import annotations

import pytest

from chronoq.console.access import addressed_here
from chronoq.core import errors
from chronoq.core.console_settings import parse


@pytest.mark.parametrize("host", ["127.0.0.1:8082", "127.0.0.1", "[::1]:8082", "[::1]", "10.1.2.3:80",
                                  "localhost:8082", "LOCALHOST", "app.localhost:8082", "ops.internal:8082"])
def test_addresses_of_this_machine_and_listed_names_pass(host):
    assert addressed_here(host, ("ops.internal",))


@pytest.mark.parametrize("host", ["evil.example:8082", "evil.example", "127.0.0.1.evil.example", "", None,
                                  "localhost.evil.example", "[::1", "ops.internal.evil:8082"])
def test_other_names_do_not(host):
    assert not addressed_here(host, ("ops.internal",))


def test_allowed_hosts_setting():
    assert parse({"allowed_hosts": ["Ops.Internal ", "broker-1"]}).allowed_hosts == ("ops.internal", "broker-1")
    assert parse(None).allowed_hosts == ()
    for bad in ("ops.internal", ["http://x"], ["x:8082"], [""], [5]):
        with pytest.raises(errors.ClientError, match="allowed_hosts"):
            parse({"allowed_hosts": bad})

"""Access control (``chronoq.core.acl``): the MQv2-HMAC-SHA1 check, permissions, and the [auth] table."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from chronoq.core import acl
from chronoq.core import errors
from chronoq.core.config import BrokerConfig

DATE = "20250102T030405Z"


def _control(**overrides) -> acl.AccessControl:
    users = [
        {"access_key": "app", "secret_key": "app-secret", "publish": ["orders", "orders.*"],
         "subscribe": ["orders*", "%DLQ%billing"], "groups": ["billing*"]},
        {"access_key": "root", "secret_key": "root-secret", "admin": True},
    ]
    table = {"enabled": True, "users": users, **overrides}
    control = acl.from_config(table)
    assert control is not None
    return control


def _header(ak: str, secret: str, date: str = DATE, upper: bool = False) -> str:
    sig = hmac.new(secret.encode(), date.encode(), hashlib.sha1).hexdigest()
    return f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, Signature={sig.upper() if upper else sig}"


def test_python_lower_and_node_upper_case_signatures_both_verify():
    control = _control()
    assert control.authenticate(_header("app", "app-secret"), DATE).access_key == "app"
    assert control.authenticate(_header("app", "app-secret", upper=True), DATE).access_key == "app"
    # The Python client's own signer produces the same header.
    from rocketmq.v5.util.signature import Signature

    assert control.authenticate(acl.authorization_header("app", "app-secret", DATE), DATE).access_key == "app"
    assert Signature.sign("app-secret", DATE) == acl.sign("app-secret", DATE)


def test_no_freshness_check_on_the_date():
    # The Python client sends local time with a literal Z; any date string that was signed verifies.
    control = _control()
    for date in ("19990101T000000Z", "20991231T235959Z", "not even a date"):
        assert control.authenticate(_header("app", "app-secret", date), date).access_key == "app"


@pytest.mark.parametrize("header, date, fragment", [
    (None, DATE, "authentication required"),
    ("", DATE, "authentication required"),
    (_header("", ""), DATE, "no access key"),              # the Python client without credentials
    (_header("nobody", "x"), DATE, "unknown access key 'nobody'"),
    (_header("app", "wrong"), DATE, "signature mismatch for access key 'app'"),
    (_header("app", "app-secret"), "20250102T030406Z", "signature mismatch"),  # signed another date
    (_header("app", "app-secret"), "", "x-mq-date-time header is missing"),
    ("Basic YWxhZGRpbjpvcGVuc2VzYW1l", DATE, "scheme 'Basic' is not supported"),
    ("MQv2-HMAC-SHA1 garbage", DATE, "malformed"),
    ("MQv2-HMAC-SHA1 Credential=app, Signature=zz" + "0" * 38, DATE, "not hex"),
    ("MQv2-HMAC-SHA1 Credential=app, Signature=abcd", DATE, "40 hex digits"),
])
def test_refusals_are_unauthorized_with_a_clear_message(header, date, fragment):
    with pytest.raises(errors.Unauthorized) as info:
        _control().authenticate(header, date)
    assert fragment in info.value.message
    assert "app-secret" not in info.value.message


def test_credential_scope_after_a_slash_is_ignored():
    sig = acl.sign("app-secret", DATE)
    header = f"MQv2-HMAC-SHA1 Credential=app/20250102/cn/mq, SignedHeaders=x-mq-date-time, Signature={sig}"
    assert _control().authenticate(header, DATE).access_key == "app"


def test_permissions_are_globs_and_deny_by_default():
    control = _control()
    app = control.users["app"]
    control.require(app, [(acl.PUBLISH, "orders"), (acl.PUBLISH, "orders.eu")], "SendMessage")
    control.require(app, [(acl.SUBSCRIBE, "orders-archive"), (acl.GROUP, "billing-eu")], "ReceiveMessage")
    control.require(app, [(acl.TOPIC, "orders-archive")], "QueryRoute")  # subscribe is enough for a route
    control.require(app, [(acl.SUBSCRIBE, "%DLQ%billing")], "ReceiveMessage")  # spelled out: allowed
    for needs, fragment in [
        ([(acl.PUBLISH, "orders-archive")], "may not publish to topic 'orders-archive'"),
        ([(acl.SUBSCRIBE, "payments")], "may not subscribe to topic 'payments'"),
        ([(acl.GROUP, "fraud")], "may not use consumer group 'fraud'"),
        ([(acl.TOPIC, "payments")], "may not use topic 'payments'"),
        ([(acl.ADMIN, "")], "needs the admin role"),
        ([(acl.PUBLISH, "")], "may not publish to topic ''"),  # naming nothing grants nothing
    ]:
        with pytest.raises(errors.Forbidden) as info:
            control.require(app, needs, "X")
        assert fragment in info.value.message
    root = control.users["root"]
    control.require(root, [(acl.ADMIN, ""), (acl.PUBLISH, "anything"), (acl.GROUP, "any")], "CreateTopic")


def test_star_does_not_open_the_brokers_own_topics():
    control = acl.from_config({"enabled": True, "users": [
        {"access_key": "wide", "secret_key": "s", "publish": ["*"], "subscribe": ["*"], "groups": ["*"]}]})
    wide = control.users["wide"]
    assert wide.allowed(acl.SUBSCRIBE, "orders")
    for system_topic in ("CHRONOQ_TXN_HALF", "%DLQ%billing", "%RETRY%billing_orders", "SCHEDULE_TOPIC_XXXX"):
        assert not wide.allowed(acl.SUBSCRIBE, system_topic)


def test_secrets_stay_out_of_reprs_and_config_reprs():
    control = _control()
    assert "app-secret" not in repr(control) and "app-secret" not in repr(control.users["app"])
    cfg = BrokerConfig(extra={"auth": {"enabled": True, "users": [{"access_key": "a", "secret_key": "hush"}]}})
    assert "hush" not in repr(cfg.validate())


def test_secret_from_the_environment():
    control = acl.from_config({"enabled": True, "users": [{"access_key": "a", "secret_key_env": "A_SECRET"}]},
                              env={"A_SECRET": "from-env"})
    assert control.authenticate(_header("a", "from-env"), DATE).access_key == "a"
    with pytest.raises(errors.ClientError, match="A_SECRET .* is not set"):
        acl.from_config({"enabled": True, "users": [{"access_key": "a", "secret_key_env": "A_SECRET"}]}, env={})


def test_disabled_or_absent_means_no_access_control():
    assert acl.from_config(None) is None
    assert acl.from_config({"enabled": False, "users": []}) is None
    assert acl.from_config({"enabled": False, "users": [{"access_key": "a", "secret_key": "s"}]}) is None  # said so


def test_replication_credentials_without_access_control_here_are_warned_of():
    open_one = BrokerConfig(replication_access_key="root", replication_secret_key="s").validate()
    assert "this node's [auth] is off" in open_one.open_replica_warning()
    closed = BrokerConfig(replication_access_key="root", replication_secret_key="s", extra={"auth": {
        "enabled": True, "users": [{"access_key": "root", "secret_key": "s", "admin": True}]}}).validate()
    assert closed.open_replica_warning() is None


@pytest.mark.parametrize("table, fragment", [
    ({"enabled": True}, "no [[auth.users]]"),
    ({"enabled": "yes", "users": []}, "enabled must be true or false"),
    ({"enabled": True, "users": [{"access_key": "a", "secret_key": "s"}], "anonymous": True}, "unknown setting"),
    ({"enabled": True, "users": [{"access_key": "a b", "secret_key": "s"}]}, "access_key must be"),
    ({"enabled": True, "users": [{"access_key": "a", "secret_key": ""}]}, "secret_key must be a non-empty"),
    ({"enabled": True, "users": [{"access_key": "a"}]}, "exactly one of secret_key and secret_key_env"),
    ({"enabled": True, "users": [{"access_key": "a", "secret_key": "s", "publish": "orders"}]}, "publish must be"),
    ({"enabled": True, "users": [{"access_key": "a", "secret_key": "s", "admin": 1}]}, "admin must be"),
    ({"enabled": True, "users": [{"access_key": "a", "secret_key": "s", "pubish": []}]}, "unknown setting"),
    ({"enabled": True, "users": [{"access_key": "a", "secret_key": "s"}, {"access_key": "a", "secret_key": "t"}]},
     "listed twice"),
    ({"users": [{"access_key": "a", "secret_key": "s"}]}, "does not say enabled = true"),  # (an open broker)
])
def test_bad_auth_tables_are_refused_at_load(table, fragment):
    with pytest.raises(errors.ClientError) as info:
        BrokerConfig(extra={"auth": table}).validate()
    assert fragment in info.value.message


def test_security_settings_are_validated():
    with pytest.raises(errors.ClientError, match="both tls_cert_file and tls_key_file"):
        BrokerConfig(tls_cert_file="/x.pem").validate()
    with pytest.raises(errors.ClientError, match="max_parked_polls must be positive"):
        BrokerConfig(max_parked_polls=0).validate()
    with pytest.raises(errors.ClientError, match="disk_reserve_bytes may not be negative"):
        BrokerConfig(disk_reserve_bytes=-1).validate()


def test_every_messaging_method_has_an_access_rule():
    """A MessagingService method without a rule would be admin-only: make that a decision."""
    from google.protobuf import descriptor_pool
    from rocketmq.grpc_protocol import service_pb2  # noqa: F401 - registers the descriptors

    from chronoq.server import auth

    service = descriptor_pool.Default().FindServiceByName("apache.rocketmq.v2.MessagingService")
    ruled = {path.rsplit("/", 1)[1] for path in auth.RULES if path.startswith(auth.MS)}
    assert {m.name for m in service.methods} - ruled == {"SyncLiteSubscription"}  # unsupported: admins only

"""The public imports the README and docs use keep working after the tree's moves."""

import pytest


def test_embedded_broker_and_client_import_from_their_packages():
    import chronoq.broker
    import chronoq.client
    from chronoq.broker import Broker, OutgoingMessage
    from chronoq.broker import broker as broker_module
    from chronoq.client import AdminClient, Client, ClientError
    from chronoq.client import admin as admin_module
    from chronoq.client import client as client_module

    assert Broker is broker_module.Broker and OutgoingMessage is broker_module.OutgoingMessage
    assert (Client, AdminClient, ClientError) == (client_module.Client, admin_module.AdminClient,
                                                 client_module.ClientError)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        chronoq.broker.Nope
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        chronoq.client.Nope


def test_the_console_script_entry_point_resolves():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "chronoq"]
    from chronoq.cli.main import main
    assert ep.load() is main

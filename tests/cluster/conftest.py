"""The network-fault tests act on a namespace cluster (a2a.cluster), which needs root: they run only when
asked (make test-cluster sets A2A_TEST_CLUSTER=1), so that a plain `pytest` never makes namespaces."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("A2A_TEST_CLUSTER") != "1":
        reason = "network faults on a namespace cluster: make test-cluster (A2A_TEST_CLUSTER=1)"
    elif os.geteuid() != 0:
        reason = "network faults on a namespace cluster need root"
    else:
        return
    for item in items:
        item.add_marker(pytest.mark.skip(reason=reason))

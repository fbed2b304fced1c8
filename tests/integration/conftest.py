from __future__ import annotations

import pytest

from tests.integration.harness import LocalCluster


@pytest.fixture
async def local_cluster(etcd_endpoint, cluster_name, tmp_path):
    c = LocalCluster(etcd_endpoint, cluster_name, tmp_path)
    await c.start()
    try:
        yield c
    finally:
        await c.close()

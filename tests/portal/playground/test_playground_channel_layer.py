"""The playground's socket does not depend on the channel layer: a layer whose receive fails
(as channels_redis's did when redis-py's 5 s socket timeout beat its 5 s BZPOPMIN on a busy
loop) must not close it. No worker needed: only messages answered by the consumer itself."""

from __future__ import annotations

import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer

from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
from tests.portal.playground.conftest import communicator, session_cookie


class FailingReceiveLayer(InMemoryChannelLayer):
    async def receive(self, channel):
        await asyncio.sleep(0.05)
        raise TimeoutError("Timeout reading from 127.0.0.1:6379")


@database_sync_to_async
def member_cookie(user_model) -> str:
    tenant = tenant_create(slug="acme", name="Acme")
    user = user_model.objects.create_user(username="ada", password="x")
    membership_create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    return session_cookie(user)


@pytest.mark.django_db(transaction=True)
async def test_a_failing_channel_layer_does_not_drop_the_socket(settings, django_user_model):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": f"{__name__}.FailingReceiveLayer"}}
    comm = communicator("acme", await member_cookie(django_user_model))
    connected, _ = await comm.connect()
    assert connected
    assert (await comm.receive_json_from())["type"] == "ready"
    await asyncio.sleep(0.3)  # several failed layer receives, had the consumer listened
    await comm.send_json_to({"type": "hello"})
    reply = await comm.receive_json_from()
    assert reply["type"] == "error" and reply["code"] == "invalid_message"
    await comm.send_json_to({"type": "cancel"})  # nothing running: no answer, still open
    assert await comm.receive_nothing(timeout=0.2)
    await comm.disconnect()


def test_the_redis_layer_reads_longer_than_it_blocks(settings):
    """With REDIS_URL set (as the test command sets it) the layer is channels_redis; its blocking
    receive (BZPOPMIN, brpop_timeout) must end before redis-py's socket read gives up."""
    from channels.layers import get_channel_layer
    from channels_redis.utils import create_pool

    if not settings.REDIS_URL:
        pytest.skip("REDIS_URL is unset: the in-memory layer has no socket")
    layer = get_channel_layer()
    [host] = layer.hosts
    pool = create_pool(host)
    assert pool.connection_kwargs["socket_timeout"] > layer.brpop_timeout

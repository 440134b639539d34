"""/v1/models gives a real `created`: when the worker started, not the time of the request."""

from __future__ import annotations

import re
import time


def test_created_is_the_workers_start_not_now(server, client):
    loaded_in = float(re.search(r"model loaded in ([0-9.]+)s", server.log).group(1))

    models = client.models.list().data

    # The app was created before the model loaded, so its start lies at least that long ago.
    assert len({m.created for m in models}) == 1
    assert 0 < models[0].created <= int(time.time() - loaded_in)
    assert [m.created for m in client.models.list().data] == [m.created for m in models]

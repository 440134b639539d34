"""What the fleet tells other apps, without importing them.

fleet_polled is sent after every fleet poll has written its rows (inside the poll's process,
after commit). Keyword arguments:
    workers: list[InferenceWorker]  every enabled row just polled (healthy or not)
    came_up: set[str]               URLs that are healthy now and were not before this poll (a
                                    new worker, a restarted one, one back from an outage)
    listed: set[str]                URLs whose full adapter list was read (GET /v1/adapters with
                                    the admin token): their resident_adapters holds every
                                    registered adapter, "disk" tier included

portal.adapters connects a receiver that stages the deployed adapters a worker lacks.
"""

from django.dispatch import Signal

fleet_polled = Signal()

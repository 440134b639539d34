from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class GatewayConfig(AppConfig):
    name = "portal.gateway"
    label = "gateway"
    verbose_name = "API gateway"

    def ready(self) -> None:
        # The rows the gateway's access caches are read from (portal.gateway.cache): a write to
        # any of them, through its service or the admin, invalidates them in every web process.
        from portal.adapters.models import Adapter, AdapterVersion, Deployment
        from portal.fleet.models import InferenceWorker
        from portal.fleet.signals import fleet_polled
        from portal.gateway.cache import fleet_forget, invalidate_on_commit
        from portal.keys.models import ApiKey
        from portal.quotas.models import Quota
        from portal.tenants.models import Tenant

        for model in (ApiKey, Tenant, Quota, Adapter, AdapterVersion, Deployment):
            for signal in (post_save, post_delete):
                signal.connect(invalidate_on_commit, sender=model,
                               dispatch_uid=f"gateway-cache-{signal is post_save}-{model.__name__}")
        # The fleet's rows, where this process learns of a change (a poll run here, the admin):
        # elsewhere they are served FLEET_STALE_TTL seconds at most (portal.gateway.cache.FleetValues).
        fleet_polled.connect(fleet_forget, dispatch_uid="gateway-cache-fleet-polled")
        for signal in (post_save, post_delete):
            signal.connect(fleet_forget, sender=InferenceWorker,
                           dispatch_uid=f"gateway-cache-{signal is post_save}-InferenceWorker")

import os

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from portal.demo.services import DEMO_ADMIN_USERNAME, demo_adapters_register, demo_bootstrap

DEFAULT_DEMO_PASSWORD = "admin"


class Command(BaseCommand):
    help = (
        "Create (idempotently) the demo staff user 'admin', the tenant 'demo' it owns and one "
        "API key, printed once. Password from DEMO_ADMIN_PASSWORD (default 'admin')."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--new-key",
            action="store_true",
            help="create another demo API key even if a usable one exists",
        )

    def handle(self, *args, new_key: bool, **options):
        password = os.environ.get("DEMO_ADMIN_PASSWORD") or DEFAULT_DEMO_PASSWORD
        using_default_password = password == DEFAULT_DEMO_PASSWORD
        if using_default_password and settings.CONFIG.is_production:
            raise CommandError(
                "DEMO_ADMIN_PASSWORD: required in production (the default is 'admin')"
            )

        result = demo_bootstrap(admin_password=password, new_key=new_key)

        if result.admin_created:
            self.stdout.write(f"Created staff superuser '{DEMO_ADMIN_USERNAME}'.")
            if using_default_password:
                self.stderr.write(
                    self.style.WARNING(
                        f"WARNING: '{DEMO_ADMIN_USERNAME}' has the default password "
                        f"'{DEFAULT_DEMO_PASSWORD}'; set DEMO_ADMIN_PASSWORD for anything but a local demo."
                    )
                )
        else:
            self.stdout.write(
                f"Staff user '{DEMO_ADMIN_USERNAME}' already exists (password unchanged)."
            )

        verb = "Created" if result.tenant_created else "Found"
        self.stdout.write(f"{verb} tenant '{result.tenant.slug}' owned by '{DEMO_ADMIN_USERNAME}'.")

        if result.plaintext_key is None:
            self.stdout.write(
                f"A demo API key already exists: {result.api_key.display_prefix} "
                "(its secret was shown when it was created; use --new-key for another)."
            )
        else:
            self.stdout.write(self.style.SUCCESS(f"API key (shown once): {result.plaintext_key}"))

        # Validation is a task enqueued on commit (in-process without REDIS_URL, else the
        # Celery worker's); staging to the inference workers follows it.
        with transaction.atomic():
            uploaded = demo_adapters_register(tenant=result.tenant, actor=result.admin)
            for version in uploaded:
                self.stdout.write(f"Demo adapter {version.public_id}: uploaded, validating after commit.")
        for version in uploaded:
            version.refresh_from_db()
            if version.status != version.Status.UPLOADED:  # validated in-process (no Celery worker)
                self.stdout.write(f"Demo adapter {version.public_id}: {version.get_status_display().lower()}.")
        if any(entry.get("status") == "failed" for v in uploaded for entry in (v.staging or {}).values()):
            # make run starts the inference worker after this command, so staging finds nobody.
            self.stdout.write("No inference worker answered yet, so the adapters were not staged; "
                              "a worker loads each one on its first request.")

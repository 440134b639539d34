"""The demo data `make run` creates (manage.py bootstrap_demo): writes that span the apps."""

from dataclasses import dataclass
from pathlib import Path

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractUser
from django.core.files import File
from django.db import transaction

from portal.adapters.models import Adapter, AdapterVersion
from portal.adapters.services import adapter_create, adapter_version_upload
from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_list
from portal.keys.services import api_key_create
from portal.tenants.models import Membership, Tenant
from portal.tenants.selectors import membership_get, tenant_get_by_slug
from portal.tenants.services import membership_create, membership_set_role, tenant_create

DEMO_ADMIN_USERNAME = "admin"
DEMO_TENANT_SLUG = "demo"
DEMO_TENANT_NAME = "Demo tenant"
DEMO_KEY_NAME = "demo"
# The demo adapters the repository ships (trained by demo/train_adapters.py), registered for
# the demo tenant through the same upload -> validate -> stage path a tenant's uploads take.
DEMO_ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "demo" / "adapters"
DEMO_ADAPTERS = {
    "pirate": "Answers as a pirate would.",
    "json": "Answers only with a JSON object.",
    "french": "Answers in French.",
}
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class DemoBootstrapResult:
    admin: AbstractUser
    admin_created: bool
    tenant: Tenant
    tenant_created: bool
    api_key: ApiKey
    plaintext_key: str | None  # None when an existing key was kept: its secret is not stored


@transaction.atomic
def demo_bootstrap(*, admin_password: str, new_key: bool = False) -> DemoBootstrapResult:
    """Idempotent: a staff superuser, a demo tenant it owns, and one usable demo API key.

    An existing admin keeps its password; an existing usable demo key is kept unless
    `new_key` asks for another.
    """
    admin, admin_created = _demo_admin_ensure(password=admin_password)

    tenant = tenant_get_by_slug(slug=DEMO_TENANT_SLUG)
    tenant_created = tenant is None
    if tenant is None:
        tenant = tenant_create(slug=DEMO_TENANT_SLUG, name=DEMO_TENANT_NAME, plan=Tenant.Plan.TEAM)

    membership = membership_get(tenant=tenant, user=admin)
    if membership is None:
        membership_create(tenant=tenant, user=admin, role=Membership.Role.OWNER)
    elif membership.role != Membership.Role.OWNER:
        membership_set_role(membership=membership, role=Membership.Role.OWNER)

    existing_key = api_key_list(tenant=tenant, usable_only=True).filter(name=DEMO_KEY_NAME).first()
    if existing_key is not None and not new_key:
        api_key, plaintext = existing_key, None
    else:
        api_key, plaintext = api_key_create(tenant=tenant, name=DEMO_KEY_NAME, created_by=admin)

    return DemoBootstrapResult(
        admin=admin,
        admin_created=admin_created,
        tenant=tenant,
        tenant_created=tenant_created,
        api_key=api_key,
        plaintext_key=plaintext,
    )


def demo_adapters_register(*, tenant: Tenant, actor: AbstractUser | None) -> list[AdapterVersion]:
    """Upload each shipped demo adapter the tenant does not have yet (idempotent: an adapter
    with any version is left alone). Returns the versions uploaded now; their validation runs
    as a task after commit, staging follows it, and the gateway loads lazily on first use."""
    uploaded = []
    for name, description in DEMO_ADAPTERS.items():
        directory = DEMO_ADAPTERS_DIR / name
        if not all((directory / f).is_file() for f in PEFT_FILES):
            continue  # a checkout without the trained files: nothing to register
        adapter = Adapter.objects.filter(tenant=tenant, name=name).first()
        if adapter is not None and adapter.versions.exists():
            continue
        if adapter is None:
            adapter = adapter_create(tenant=tenant, name=name, description=description,
                                     base_model="HuggingFaceTB/SmolLM2-135M-Instruct", actor=actor)  # fmt: skip
        handles = [open(directory / f, "rb") for f in PEFT_FILES]  # noqa: SIM115 -- closed below
        try:
            files = [File(h, name=f) for h, f in zip(handles, PEFT_FILES, strict=True)]
            uploaded.append(adapter_version_upload(adapter=adapter, files=files, actor=actor))
        finally:
            for h in handles:
                h.close()
    return uploaded


def _demo_admin_ensure(*, password: str) -> tuple[AbstractUser, bool]:
    user_model = get_user_model()
    admin = user_model.objects.filter(username=DEMO_ADMIN_USERNAME).first()
    if admin is None:
        admin = user_model.objects.create_superuser(
            username=DEMO_ADMIN_USERNAME, email="admin@localhost", password=password
        )
        return admin, True
    if not (admin.is_staff and admin.is_superuser and admin.is_active):
        admin.is_staff = admin.is_superuser = admin.is_active = True
        admin.save(update_fields=["is_staff", "is_superuser", "is_active"])
    return admin, False

"""Writes on adapters: create, update, delete, upload versions, validate, retire; the audit trail.

Uploads are streamed to Django's default storage (local directory or S3 through
django-storages), never held whole in memory:

    adapters/<version uid hex>/adapter_config.json           file uploads land here directly
    adapters/<version uid hex>/adapter_model.safetensors
    adapters/<version uid hex>/upload/<name>.zip|.tar.gz     archives wait here for validation,
                                                             which extracts the two files beside it

Only those two files are ever stored: the model card, tokenizer and other harmless files that
save_pretrained or the Trainer write beside them are accepted and dropped (protocol/adapter_format/files.py),
pickles and unknown binaries refused, the same way for files and for an archive's contents.

Validation runs as a Celery task enqueued on commit; the version goes uploaded -> validating
-> ready (staged to the workers) or rejected (every reason stored, its files deleted). Retired
versions lose their files and are never resolved again.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from portal.adapters import limits, selectors, staging
from portal.adapters.archive import ArchiveError, archive_kind, extract_archive, find_adapter_root
from portal.adapters.models import Adapter, AdapterVersion, AuditEvent, Deployment
from portal.adapters.validation import EXPECTED, content_sha256, validate_adapter_dir
from portal.core.exceptions import InvalidInput, full_clean_or_raise
from portal.core.jobs import enqueue
from portal.evals.services import evaluation_on_version_ready
from portal.tenants.models import Tenant
from protocol.adapter_format import ADAPTER_FILES, BaseShapes
from protocol.adapter_format.files import SNIFF_BYTES, file_role

logger = logging.getLogger(__name__)

STORAGE_PREFIX = "adapters"
CHUNK = 1 << 20
UNEXPECTED_FAILURE = "validation failed unexpectedly (the error is logged); upload the version again"
# The validation task's registered name (portal.adapters.tasks calls this module; see portal.core.jobs).
VALIDATE_TASK = "portal.adapters.tasks.adapter_version_validate_task"


# --- audit -----------------------------------------------------------------------------------


def audit_event_create(
    *, tenant: Tenant, actor: AbstractBaseUser | None, action: str, target: str, details: dict | None = None
) -> AuditEvent:
    actor = actor if actor is not None and getattr(actor, "is_authenticated", False) else None
    return AuditEvent.objects.create(tenant=tenant, actor=actor, action=action, target=target, details=details or {})


# --- adapters --------------------------------------------------------------------------------


@transaction.atomic
def adapter_create(
    *, tenant: Tenant, name: str, description: str = "", base_model: str = "", actor: AbstractBaseUser | None
) -> Adapter:
    """A new adapter (no versions yet) with an empty deployment (newest ready version wins)."""
    Tenant.objects.select_for_update().filter(pk=tenant.pk).first()  # serialise the count check
    name = (name or "").strip()
    if Adapter.objects.filter(tenant=tenant, name=name).exists():
        raise InvalidInput("name", f"{tenant.slug} already has an adapter named {name!r}")
    limits.check_adapter_count(tenant=tenant)
    adapter = Adapter(tenant=tenant, name=name, description=description or "", base_model=(base_model or "").strip())
    full_clean_or_raise(adapter)
    adapter.save()
    Deployment.objects.create(adapter=adapter, updated_by=_user(actor))
    audit_event_create(tenant=tenant, actor=actor, action="adapter.created", target=adapter.public_id)
    return adapter


@transaction.atomic
def adapter_update(
    *, adapter: Adapter, actor: AbstractBaseUser | None, description: str | None = None, base_model: str | None = None
) -> Adapter:
    changes: dict[str, Any] = {}
    if description is not None and description != adapter.description:
        changes["description"] = description
    if base_model is not None and base_model.strip() != adapter.base_model:
        changes["base_model"] = base_model.strip()
    if not changes:
        return adapter
    for key, value in changes.items():
        setattr(adapter, key, value)
    full_clean_or_raise(adapter)
    adapter.save(update_fields=[*changes, "updated_at"])
    audit_event_create(
        tenant=adapter.tenant, actor=actor, action="adapter.updated", target=adapter.public_id, details=changes
    )
    return adapter


def adapter_delete(*, adapter: Adapter, actor: AbstractBaseUser | None) -> None:
    """Retire every version (unloaded from the workers, files deleted), then delete the adapter.

    The versions' rows go with it, so nothing can resolve them again; usage rows keep their
    history (their adapter_version becomes null)."""
    with transaction.atomic():
        adapter = Adapter.objects.select_for_update().select_related("tenant").get(pk=adapter.pk)
        versions = list(adapter.versions.all())
        for version in versions:
            if version.status != AdapterVersion.Status.RETIRED:
                _retire(version)
        audit_event_create(
            tenant=adapter.tenant,
            actor=actor,
            action="adapter.deleted",
            target=adapter.public_id,
            details={"versions": [v.number for v in versions]},
        )
        adapter.delete()
        for version in versions:
            transaction.on_commit(lambda v=version: _after_retire(v))


# --- uploads -------------------------------------------------------------------------------------


class _CappedFile(File):
    """An uploaded file read in chunks that refuses to yield more than `budget` bytes in all
    (the multipart size is what the client declared; this is what it actually sent)."""

    def __init__(self, file, *, counter: list[int], budget: int):
        super().__init__(file, name=getattr(file, "name", None))
        self._counter, self._budget = counter, budget

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size if size and size > 0 else CHUNK)
        self._counter[0] += len(data)
        if self._counter[0] > self._budget:
            raise limits.LimitExceeded(
                "files", f"the upload is more than {self._budget} bytes; the limit is {self._budget} bytes", status_code=413
            )
        return data

    def chunks(self, chunk_size: int | None = None):
        if hasattr(self.file, "seek"):
            self.file.seek(0)
        while data := self.read(chunk_size or CHUNK):
            yield data

    def multiple_chunks(self, chunk_size=None) -> bool:
        return True


def _upload_plan(files: list) -> tuple[str, dict[str, Any], list[str]]:
    """Check the shape of an upload -> (kind, {stored name: file}, ignored names):
    ("files", the two PEFT files, the harmless companions beside them that are not stored) or
    ("archive", {name: the one .zip/.tar.gz}, []). InvalidInput names every refused file and why,
    then says what is expected; the same rules judge an archive's contents (protocol/adapter_format/files.py)."""
    if not files:
        raise InvalidInput("files", f"the upload is empty: {EXPECTED}")
    names = [Path(str(getattr(f, "name", "") or "").replace("\\", "/")).name for f in files]
    if not all(names):
        raise InvalidInput("files", f"a file has no name: {EXPECTED}")
    if len(files) == 1 and archive_kind(names[0]):
        if not files[0].size:
            raise InvalidInput("files", f"{names[0]} is empty (0 bytes)")
        return "archive", {names[0]: files[0]}, []

    adapter: dict[str, Any] = {}
    ignored: list[str] = []
    refusals: list[str] = []
    for name, f in zip(names, files, strict=True):
        if archive_kind(name):
            refusals.append(f"{name} is an archive: send it on its own, or the directory's files without it")
            continue
        role = file_role(name, read_head=lambda f=f: _head(f))
        if role.refused:
            refusals.append(role.reason)
        elif role.kind == "ignored":
            ignored.append(name)
        elif name in adapter:
            refusals.append(f"{name} was sent twice")
        elif not f.size:
            refusals.append(f"{name} is empty (0 bytes)")
        else:
            adapter[name] = f
    if refusals:
        raise InvalidInput("files", f"{'; '.join(refusals)}. To add a version, {EXPECTED}")
    missing = [n for n in ADAPTER_FILES if n not in adapter]
    if missing:
        raise InvalidInput("files", f"missing {' and '.join(missing)} (got {', '.join(names)}): {EXPECTED}")
    return "files", adapter, sorted(ignored)


def _head(f) -> bytes:
    """The first bytes of an uploaded file, its position left at the start for the later copy."""
    f.seek(0)
    head = f.read(SNIFF_BYTES)
    f.seek(0)
    return head if isinstance(head, bytes) else head.encode()


def adapter_version_upload(*, adapter: Adapter, files: list, actor: AbstractBaseUser | None) -> AdapterVersion:
    """Store an upload as the adapter's next version (status uploaded) and enqueue its validation.

    `files`: Django UploadedFiles (or any File with name, size and chunks()). Checked before a
    byte is stored: the shape of the upload, settings.MAX_UPLOAD_BYTES (LimitExceeded, 413),
    the tenant's storage limit. The bytes actually read are capped again while streaming."""
    kind, named, ignored = _upload_plan(files)
    declared = sum(int(f.size) for f in named.values())
    limits.check_upload_size(size=declared)
    limits.check_storage(tenant=adapter.tenant, incoming=declared)

    uid = uuid.uuid4()
    storage_dir = f"{STORAGE_PREFIX}/{uid.hex}"
    counter = [0]
    stored: list[str] = []
    try:
        for name, f in named.items():
            target = f"{storage_dir}/upload/{name}" if kind == "archive" else f"{storage_dir}/{name}"
            stored.append(default_storage.save(target, _CappedFile(f, counter=counter, budget=limits.max_upload_bytes())))
        if counter[0] == 0:
            raise InvalidInput("files", "the upload is empty (0 bytes)")
        with transaction.atomic():
            tenant = Tenant.objects.select_for_update().get(pk=adapter.tenant_id)
            limits.check_storage(tenant=tenant, incoming=counter[0])  # again, under the lock
            adapter = Adapter.objects.select_for_update().select_related("tenant").get(pk=adapter.pk)
            number = (adapter.versions.aggregate(n=Max("number"))["n"] or 0) + 1
            version = AdapterVersion.objects.create(
                adapter=adapter,
                number=number,
                uid=uid,
                status=AdapterVersion.Status.UPLOADED,
                storage_dir=storage_dir,
                size_bytes=counter[0],
                created_by=_user(actor),
            )
            audit_event_create(
                tenant=adapter.tenant,
                actor=actor,
                action="version.uploaded",
                target=version.public_id,
                details={"files": sorted(named), "ignored": ignored, "size_bytes": counter[0]},
            )
            transaction.on_commit(lambda: _enqueue_validation(version.id))
    except BaseException:
        _delete_stored(stored, storage_dir)
        raise
    return version


def _enqueue_validation(version_id: int) -> None:
    enqueue(VALIDATE_TASK, version_id)


# --- validation ----------------------------------------------------------------------------------


def adapter_version_validate(*, version_id: int, base: BaseShapes | None = None) -> AdapterVersion | None:
    """Validate an uploaded version: ready (then staged) or rejected with every reason.

    Idempotent: a version not in uploaded/validating (already judged, retired, deleted) is left
    alone and None is returned."""
    with transaction.atomic():
        version = (
            AdapterVersion.objects.select_for_update().select_related("adapter__tenant").filter(pk=version_id).first()
        )
        if version is None or version.status not in (AdapterVersion.Status.UPLOADED, AdapterVersion.Status.VALIDATING):
            return None
        version.status = AdapterVersion.Status.VALIDATING
        version.save(update_fields=["status", "updated_at"])

    if base is None:
        base = selectors.base_shapes_current()  # a module attribute: tests stand in a tiny base
    try:
        with tempfile.TemporaryDirectory(prefix="adapter-validate-") as tmp:
            reasons, outcome = _validate_stored(version, Path(tmp), base)
            return _finish_validation(version, reasons, outcome)
    except Exception:
        logger.exception("validating %s failed unexpectedly", version)
        return _finish_validation(version, [UNEXPECTED_FAILURE], None)


def _validate_stored(version: AdapterVersion, tmp: Path, base: BaseShapes):
    """Copy the stored upload into `tmp`, extract it, validate it -> (reasons, result or None);
    on success the two adapter files are in storage_dir."""
    work = tmp / "adapter"
    work.mkdir()
    upload_dir = f"{version.storage_dir}/upload"
    archives = _listdir(upload_dir)
    if archives:
        name = archives[0]
        local = tmp / name
        _download(f"{upload_dir}/{name}", local)
        try:
            extract_archive(
                local,
                work,
                kind=archive_kind(name) or "",
                max_files=limits.max_archive_files(),
                max_bytes=limits.max_extracted_bytes(),
            )
        except ArchiveError as e:
            return e.reasons, None
        local.unlink()
        root = find_adapter_root(work)
    else:
        for name in ADAPTER_FILES:
            if default_storage.exists(f"{version.storage_dir}/{name}"):
                _download(f"{version.storage_dir}/{name}", work / name)
        root = work

    result = validate_adapter_dir(root, base)
    reasons = list(result.reasons)
    if result.ok:
        sha = content_sha256(result.file_sha256)
        duplicate = (
            AdapterVersion.objects.filter(
                adapter__tenant_id=version.adapter.tenant_id, sha256=sha, status=AdapterVersion.Status.READY
            )
            .exclude(pk=version.pk)
            .select_related("adapter__tenant")
            .first()
        )
        if duplicate is not None:
            reasons.append(f"identical to {duplicate.public_id} (sha256 {sha}); that version is already ready")
    if reasons:
        return reasons, None
    if archives:
        for name in ADAPTER_FILES:
            with open(root / name, "rb") as f:
                default_storage.save(f"{version.storage_dir}/{name}", File(f))
    return [], result


def _finish_validation(version: AdapterVersion, reasons: list[str], result) -> AdapterVersion | None:
    with transaction.atomic():
        current = (
            AdapterVersion.objects.select_for_update().select_related("adapter__tenant").filter(pk=version.pk).first()
        )
        if current is None or current.status != AdapterVersion.Status.VALIDATING:
            # Retired or deleted meanwhile: whatever this run stored is garbage now.
            storage_dir = version.storage_dir
            transaction.on_commit(lambda: _delete_dir(storage_dir))
            return None
        current.validated_at = timezone.now()
        if result is not None and not reasons:
            current.status = AdapterVersion.Status.READY
            current.rejection_reasons = []
            current.rank, current.alpha = result.rank, result.alpha
            current.target_modules = result.target_modules
            current.base_model = result.base_model
            current.file_sha256 = result.file_sha256
            current.sha256 = content_sha256(result.file_sha256)
            current.size_bytes = result.size_bytes
            current.save()
            _hold_for_evaluation(current)
            evaluation_on_version_ready(version=current)  # a queued run when the adapter has a set
            _delete_dir(f"{current.storage_dir}/upload")
            audit_event_create(
                tenant=current.adapter.tenant,
                actor=None,
                action="version.validated",
                target=current.public_id,
                details={"rank": result.rank, "sha256": current.sha256, "warnings": result.warnings},
            )
            transaction.on_commit(lambda: _stage(current))
        else:
            current.status = AdapterVersion.Status.REJECTED
            current.rejection_reasons = [str(r) for r in reasons]
            current.save()
            audit_event_create(
                tenant=current.adapter.tenant,
                actor=None,
                action="version.rejected",
                target=current.public_id,
                details={"reasons": current.rejection_reasons},
            )
            storage_dir = current.storage_dir
            transaction.on_commit(lambda: _delete_dir(storage_dir))
    return current


def _hold_for_evaluation(version: AdapterVersion) -> None:
    """With the evaluation gate on and no weights, the newest ready version serves: this one,
    before any evaluation. Pin the weights to the version that served until now instead (the
    gate then decides when this one gets traffic). Audited; nothing to do without an older
    ready version (the first version serves: there is nothing to compare it with)."""
    deployment = Deployment.objects.select_for_update().filter(adapter_id=version.adapter_id).first()
    if deployment is None or not deployment.require_evaluation or deployment.weights:
        return
    previous = (version.adapter.versions.filter(status=AdapterVersion.Status.READY, retired_at__isnull=True)
                .exclude(pk=version.pk).order_by("-number").first())
    if previous is None:
        return
    deployment.weights = {str(previous.number): 100}
    deployment.save(update_fields=["weights", "updated_at"])
    audit_event_create(
        tenant=version.adapter.tenant, actor=None, action="deployment.weights_set", target=version.adapter.public_id,
        details={"weights": deployment.weights, "previous": {},
                 "reason": f"v{version.number} is ready but must pass its evaluation before it gets traffic"},
    )


def _stage(version: AdapterVersion) -> None:
    staging.version_stage_enqueue(version=version)


# --- retire --------------------------------------------------------------------------------


def adapter_version_retire(*, version: AdapterVersion, actor: AbstractBaseUser | None) -> AdapterVersion:
    """Take a version out of service for good: never resolved again, dropped from the deployment
    weights, unloaded from every worker (requests already running finish), its files deleted."""
    with transaction.atomic():
        version = AdapterVersion.objects.select_for_update().select_related("adapter__tenant").get(pk=version.pk)
        if version.status == AdapterVersion.Status.RETIRED:
            return version
        previous = version.status
        _retire(version)
        audit_event_create(
            tenant=version.adapter.tenant,
            actor=actor,
            action="version.retired",
            target=version.public_id,
            details={"previous_status": previous},
        )
        transaction.on_commit(lambda: _after_retire(version))
    return version


def _retire(version: AdapterVersion) -> None:
    version.status = AdapterVersion.Status.RETIRED
    version.retired_at = timezone.now()
    version.save(update_fields=["status", "retired_at", "updated_at"])
    deployment = Deployment.objects.select_for_update().filter(adapter_id=version.adapter_id).first()
    if deployment is not None and str(version.number) in (deployment.weights or {}):
        weights = {k: v for k, v in deployment.weights.items() if k != str(version.number)}
        deployment.weights = weights if sum(int(v) for v in weights.values()) > 0 else {}
        deployment.save(update_fields=["weights", "updated_at"])


def _after_retire(version: AdapterVersion) -> None:
    """After commit: unload from the workers (the instance may outlive its row), free storage."""
    try:
        staging.version_unstage(version=version)
    except Exception:
        logger.exception("unstaging %s failed", version.worker_name)
    if version.storage_dir:
        _delete_dir(version.storage_dir)


# --- storage helpers -----------------------------------------------------------------------------


def _user(actor):
    return actor if actor is not None and getattr(actor, "is_authenticated", False) else None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(default_storage.listdir(path)[1])
    except (FileNotFoundError, NotADirectoryError):
        return []


def _download(name: str, local: Path) -> None:
    with default_storage.open(name, "rb") as src, open(local, "xb") as dst:
        shutil.copyfileobj(src, dst, CHUNK)


def _delete_dir(path: str) -> None:
    """Delete every file under storage directory `path` (storage has no recursive delete)."""
    try:
        dirs, files = default_storage.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in files:
        default_storage.delete(f"{path}/{name}")
    for name in dirs:
        _delete_dir(f"{path}/{name}")
    local = _local_path(path)
    if local is not None:
        shutil.rmtree(local, ignore_errors=True)


def _delete_stored(names: list[str], storage_dir: str) -> None:
    for name in names:
        try:
            default_storage.delete(name)
        except Exception:  # cleanup of a failed upload must not hide its error
            logger.exception("could not delete %s", name)
    _delete_dir(storage_dir)


def _local_path(path: str) -> Path | None:
    try:
        return Path(default_storage.path(path))
    except NotImplementedError:
        return None

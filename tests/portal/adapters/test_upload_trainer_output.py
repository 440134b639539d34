"""Uploading what the training tools actually write (issue 13, finding 9).

The oracle is a directory written by the real HF Trainer + PEFT save_pretrained (trainer_output.py):
its README.md model card and tokenizer files are accepted and ignored (never stored, never staged),
its training_args.bin pickle is refused by name, and so is a file no tool writes beside an
adapter. The REST API and archives behave the same; the console's form is in
tests/portal/console/test_upload_trainer_output.py."""

from __future__ import annotations

import pytest

from portal.adapters.models import Adapter, AdapterVersion, AuditEvent
from portal.adapters.selectors import adapter_version_resolve
from portal.adapters.services import adapter_create
from tests.portal.adapters.conftest import upload
from tests.portal.adapters.peft_files import tar_dir, write_peft, zip_bytes, zip_dir
from tests.portal.adapters.trainer_output import PICKLE, write_trainer_output

pytestmark = pytest.mark.django_db
URL = "/api/v1/tenants/acme/adapters/bot/versions/"
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def trainer_dir(tmp_path_factory):
    return write_trainer_output(tmp_path_factory.mktemp("trainer") / "my-adapter")


@pytest.fixture
def adapter(tenant, member) -> Adapter:
    return adapter_create(tenant=tenant, name="bot", actor=member)


@pytest.fixture
def good_version(api, adapter, tmp_path, django_capture_on_commit_callbacks) -> AdapterVersion:
    directory = write_peft(tmp_path / "good", seed=7)
    response = post(api, [upload(p.name, p.read_bytes()) for p in sorted(directory.iterdir())],
                    django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    version = AdapterVersion.objects.get(number=1)
    assert version.status == "ready", version.rejection_reasons
    return version


def files_of(directory, *, leave_out=()) -> list:
    """Every file of the directory, exactly as written, as a multipart upload would send them."""
    return [upload(p.name, p.read_bytes()) for p in sorted(directory.iterdir()) if p.name not in leave_out]


def post(api, files, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        return api.post(URL, {"files": files}, format="multipart")


def stored_files(storage_root) -> list[str]:
    return sorted(p.relative_to(storage_root).as_posix() for p in storage_root.rglob("*") if p.is_file())


def assert_ready_with_only_the_adapter_stored(version, trainer_dir, storage_root, staging_calls) -> None:
    assert version.status == "ready", version.rejection_reasons
    assert stored_files(storage_root) == [f"{version.storage_dir}/{name}" for name in ADAPTER_FILES]
    for name in ADAPTER_FILES:  # stored byte for byte as PEFT wrote them
        assert (storage_root / version.storage_dir / name).read_bytes() == (trainer_dir / name).read_bytes()
    assert version.size_bytes == sum((trainer_dir / name).stat().st_size for name in ADAPTER_FILES)
    assert staging_calls["stage"] == [version.uid]


def test_the_directory_as_written_minus_the_pickle_becomes_ready(
    api, adapter, trainer_dir, storage_root, staging_calls, django_capture_on_commit_callbacks
) -> None:
    response = post(api, files_of(trainer_dir, leave_out=[PICKLE]), django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    version = AdapterVersion.objects.get(adapter=adapter, number=1)
    assert_ready_with_only_the_adapter_stored(version, trainer_dir, storage_root, staging_calls)
    assert adapter_version_resolve(tenant=adapter.tenant, model="acme/bot").version == version
    uploaded = AuditEvent.objects.get(action="version.uploaded", target=version.public_id)
    assert uploaded.details["files"] == ADAPTER_FILES
    assert uploaded.details["ignored"] == ["README.md", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]


def test_the_directory_with_its_training_args_pickle_is_refused_by_name(
    api, good_version, trainer_dir, storage_root, django_capture_on_commit_callbacks
) -> None:
    before = stored_files(storage_root)
    response = post(api, files_of(trainer_dir), django_capture_on_commit_callbacks)
    assert response.status_code == 400, response.json()
    body = response.json()
    assert body["field"] == "files" and body["code"] == "invalid"
    refusals = body["detail"].split(". To add a version")[0]  # then what is accepted
    assert refusals.startswith("training_args.bin is a pickle file") and "leave it out" in refusals, body
    assert "README.md" not in refusals and "tokenizer" not in refusals  # the companions are not the problem
    assert list(AdapterVersion.objects.values_list("number", "status")) == [(1, "ready")]
    assert stored_files(storage_root) == before
    assert adapter_version_resolve(tenant=good_version.adapter.tenant, model="acme/bot").version == good_version


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_an_archive_of_the_directory_nested_in_its_folder_becomes_ready(
    api, adapter, trainer_dir, tmp_path, storage_root, staging_calls, django_capture_on_commit_callbacks, kind
) -> None:
    clean = tmp_path / "my-adapter"
    clean.mkdir()
    for p in trainer_dir.iterdir():
        if p.name != PICKLE:
            (clean / p.name).write_bytes(p.read_bytes())
    data = zip_dir(clean, prefix="my-adapter/") if kind == "zip" else tar_dir(clean, prefix="my-adapter/")
    response = post(api, [upload(f"my-adapter.{kind}", data)], django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    version = AdapterVersion.objects.get(adapter=adapter, number=1)
    assert_ready_with_only_the_adapter_stored(version, trainer_dir, storage_root, staging_calls)


def test_an_archive_with_the_pickle_is_rejected_naming_it(
    api, good_version, trainer_dir, storage_root, django_capture_on_commit_callbacks
) -> None:
    response = post(api, [upload("out.zip", zip_dir(trainer_dir, prefix="out/"))], django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    bad = AdapterVersion.objects.get(number=2)
    assert bad.status == "rejected"
    assert any("training_args.bin is a pickle file" in r for r in bad.rejection_reasons), bad.rejection_reasons
    assert not any("README.md" in r for r in bad.rejection_reasons)
    assert stored_files(storage_root) == [f"{good_version.storage_dir}/{name}" for name in ADAPTER_FILES]


# A binary no tool writes beside an adapter, and one that pretends to be text.
UNKNOWN = [
    ("optimizer_state.npz", b"PK\x03\x04" + bytes(range(256)), "is not a file PEFT"),
    ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "other than adapter_model.safetensors"),
    ("notes.json", b"\x80\x04\x95\x00\x00binary", "holds binary data"),
]


@pytest.mark.parametrize(("name", "data", "why"), UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_an_unknown_binary_is_refused_over_rest(
    api, good_version, trainer_dir, storage_root, django_capture_on_commit_callbacks, name, data, why
) -> None:
    before = stored_files(storage_root)
    files = [*files_of(trainer_dir, leave_out=[PICKLE]), upload(name, data)]
    response = post(api, files, django_capture_on_commit_callbacks)
    assert response.status_code == 400, response.json()
    detail = response.json()["detail"]
    assert detail.startswith(f"{name} ") and why in detail, detail
    assert AdapterVersion.objects.count() == 1 and stored_files(storage_root) == before


@pytest.mark.parametrize(("name", "data", "why"), UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_an_unknown_binary_in_an_archive_is_rejected(
    api, good_version, trainer_dir, storage_root, django_capture_on_commit_callbacks, name, data, why
) -> None:
    entries = {f"out/{p.name}": p.read_bytes() for p in sorted(trainer_dir.iterdir()) if p.name != PICKLE}
    response = post(api, [upload("out.zip", zip_bytes({**entries, f"out/{name}": data}))],
                    django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    bad = AdapterVersion.objects.get(number=2)
    assert bad.status == "rejected"
    assert any(r.startswith(f"{name} ") and why in r for r in bad.rejection_reasons), bad.rejection_reasons
    assert stored_files(storage_root) == [f"{good_version.storage_dir}/{name}" for name in ADAPTER_FILES]

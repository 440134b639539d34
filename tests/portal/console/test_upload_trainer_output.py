"""The console's upload form takes what the training tools actually write (issue 13, finding 9),
like the REST API (tests/portal/adapters/test_upload_trainer_output.py): the model card and
tokenizer files are accepted and dropped, training_args.bin is refused inline by name."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from portal.adapters.models import AdapterVersion
from portal.adapters.services import adapter_create
from tests.portal.adapters.peft_files import write_peft, zip_dir
from tests.portal.adapters.trainer_output import PICKLE, write_trainer_output

pytestmark = pytest.mark.django_db
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def trainer_dir(tmp_path_factory):
    return write_trainer_output(tmp_path_factory.mktemp("trainer") / "my-adapter")


def files_of(directory, *, leave_out=()) -> list:
    return [SimpleUploadedFile(p.name, p.read_bytes(), content_type="application/octet-stream")
            for p in sorted(directory.iterdir()) if p.name not in leave_out]


def stored_files(storage_root) -> list[str]:
    return sorted(p.relative_to(storage_root).as_posix() for p in storage_root.rglob("*") if p.is_file())


def test_the_form_takes_the_directory_as_written_minus_the_pickle(
    mia, tenant, member, trainer_dir, storage_root, on_commit
):
    adapter_create(tenant=tenant, name="bot", actor=member)
    with on_commit(execute=True):
        response = mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]),
                            {"files": files_of(trainer_dir, leave_out=[PICKLE])})
    assert response.status_code == 302, response.content.decode()[:2000]
    version = AdapterVersion.objects.get(adapter__name="bot")
    assert version.status == AdapterVersion.Status.READY, version.rejection_reasons
    assert stored_files(storage_root) == [f"{version.storage_dir}/{name}" for name in ADAPTER_FILES]
    page = mia.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert b"badge-ready" in page.content


def test_the_form_refuses_training_args_bin_inline_and_stores_nothing(
    mia, tenant, member, trainer_dir, storage_root, tmp_path, on_commit
):
    adapter = adapter_create(tenant=tenant, name="bot", actor=member)
    with on_commit(execute=True):  # a good v1 first: it must come through untouched
        mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]),
                 {"files": [SimpleUploadedFile("v1.zip", zip_dir(write_peft(tmp_path / "v1")))]})
    v1 = AdapterVersion.objects.get(adapter=adapter)
    assert v1.status == AdapterVersion.Status.READY, v1.rejection_reasons
    before = stored_files(storage_root)

    with on_commit(execute=True):
        response = mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]),
                            {"files": files_of(trainer_dir)})
    assert response.status_code == 400
    text = response.content.decode()
    assert 'class="error"' in text and "training_args.bin is a pickle file" in text and "leave it out" in text
    assert list(AdapterVersion.objects.values_list("number", "status")) == [(1, "ready")]
    assert stored_files(storage_root) == before


def test_the_form_refuses_an_unknown_binary_by_name(mia, tenant, member, trainer_dir, storage_root, on_commit):
    adapter_create(tenant=tenant, name="bot", actor=member)
    files = [*files_of(trainer_dir, leave_out=[PICKLE]), SimpleUploadedFile("optimizer_state.npz", b"PK\x03\x04\x00")]
    with on_commit(execute=True):
        response = mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]), {"files": files})
    assert response.status_code == 400
    assert "optimizer_state.npz is not a file PEFT or the HF Trainer writes" in response.content.decode()
    assert not AdapterVersion.objects.exists() and stored_files(storage_root) == []


def test_an_empty_companion_is_ignored_and_an_empty_adapter_file_named(mia, tenant, member, tmp_path, on_commit):
    """The form leaves empty files to the service, as the REST API does (Django's own check would
    refuse an empty added_tokens.json without naming it)."""
    adapter_create(tenant=tenant, name="bot", actor=member)
    directory = write_peft(tmp_path / "a")
    (directory / "added_tokens.json").write_bytes(b"")
    url = reverse("console:adapter-upload", args=[tenant.slug, "bot"])
    (directory / "adapter_model.safetensors").rename(tmp_path / "weights")
    (directory / "adapter_model.safetensors").write_bytes(b"")
    refused = mia.post(url, {"files": files_of(directory)})
    assert refused.status_code == 400 and "adapter_model.safetensors is empty (0 bytes)" in refused.content.decode()
    (tmp_path / "weights").replace(directory / "adapter_model.safetensors")
    with on_commit(execute=True):
        response = mia.post(url, {"files": files_of(directory)})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert AdapterVersion.objects.get().status == AdapterVersion.Status.READY

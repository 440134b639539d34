"""Upload -> validating -> ready or rejected, through the REST API and the services, with the
Celery task run eagerly on commit. Each bad upload is rejected with its reason and nothing else
changes: the tenant's good version still resolves, no file of the bad one stays in storage."""

from __future__ import annotations

import tarfile

import numpy as np
import pytest

from portal.adapters import services
from portal.adapters.models import Adapter, AdapterVersion, AuditEvent
from portal.adapters.selectors import adapter_version_resolve
from portal.adapters.services import (
    adapter_create,
    adapter_version_upload,
    adapter_version_validate,
)
from portal.adapters.validation import SMOLLM2_135M
from tests.portal.adapters.conftest import upload
from tests.portal.adapters.peft_files import (
    peft_config,
    tar_bytes,
    tar_dir,
    tar_file,
    tar_special,
    write_peft,
    zip_bytes,
    zip_dir,
    zip_lying_about_size,
    zip_symlink,
)

pytestmark = pytest.mark.django_db
URL = "/api/v1/tenants/acme/adapters/bot/versions/"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture
def adapter(tenant, member) -> Adapter:
    return adapter_create(tenant=tenant, name="bot", actor=member)


def two_files(directory) -> list:
    return [upload(p.name, p.read_bytes()) for p in sorted(directory.iterdir())]


def post(api, files, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(URL, {"files": files}, format="multipart")
    return response


def stored_files(storage_root) -> list[str]:
    return sorted(p.relative_to(storage_root).as_posix() for p in storage_root.rglob("*") if p.is_file())


@pytest.mark.parametrize("shape", ["two files", "zip", "zip of a folder", "tar.gz"])
def test_upload_validates_to_ready_and_stages(
    api, adapter, tmp_path, storage_root, staging_calls, django_capture_on_commit_callbacks, shape
) -> None:
    directory = write_peft(tmp_path / "bot")
    files = {
        "two files": lambda: two_files(directory),
        "zip": lambda: [upload("bot.zip", zip_dir(directory))],
        "zip of a folder": lambda: [upload("bot.zip", zip_dir(directory, prefix="bot/"))],
        "tar.gz": lambda: [upload("bot.tar.gz", tar_dir(directory))],
    }[shape]()
    response = post(api, files, django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    assert response.json()["status"] == "uploaded" and response.json()["number"] == 1

    version = AdapterVersion.objects.get(adapter=adapter, number=1)
    assert version.status == "ready", version.rejection_reasons
    assert (version.rank, version.alpha, version.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    assert version.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and version.validated_at
    assert len(version.sha256) == 64 and set(version.file_sha256) == {"adapter_config.json", "adapter_model.safetensors"}
    assert stored_files(storage_root) == [
        f"{version.storage_dir}/adapter_config.json", f"{version.storage_dir}/adapter_model.safetensors",
    ]  # the archive is gone  # fmt: skip
    assert version.size_bytes == sum((storage_root / f).stat().st_size for f in stored_files(storage_root))
    assert staging_calls["stage"] == [version.uid]
    assert adapter_version_resolve(tenant=adapter.tenant, model="acme/bot").version == version
    actions = list(AuditEvent.objects.filter(tenant=adapter.tenant).order_by("id").values_list("action", flat=True))
    assert actions == ["adapter.created", "version.uploaded", "version.validated"]
    status = api.get(f"{URL}1/status/").json()
    assert status["status"] == "ready" and status["rejection_reasons"] == []


def test_the_default_models_shapes(api, adapter, tmp_path, monkeypatch, django_capture_on_commit_callbacks) -> None:
    monkeypatch.setattr("portal.adapters.selectors.base_shapes_current", lambda: SMOLLM2_135M)
    directory = write_peft(tmp_path / "bot", SMOLLM2_135M, rank=2)
    assert post(api, two_files(directory), django_capture_on_commit_callbacks).status_code == 202
    assert AdapterVersion.objects.get(adapter=adapter).status == "ready"


def test_status_goes_through_validating(adapter, member, tmp_path, monkeypatch) -> None:
    seen = []
    real = services._validate_stored

    def spy(version, tmp, base):
        seen.append(AdapterVersion.objects.get(pk=version.pk).status)
        return real(version, tmp, base)

    monkeypatch.setattr("portal.adapters.services._validate_stored", spy)
    version = adapter_version_upload(adapter=adapter, files=two_files(write_peft(tmp_path / "a")), actor=member)
    assert version.status == "uploaded"
    assert adapter_version_validate(version_id=version.id).status == "ready"
    assert seen == ["validating"]
    assert adapter_version_validate(version_id=version.id) is None  # idempotent


def _bad_adapters(tmp_path):
    def d(name, **kw):
        return write_peft(tmp_path / name, **kw)

    def poison(value):
        def edit(t):
            t[Q_A][0, 0] = value
        return edit

    def wrong_shape(t):
        t[Q_A] = np.zeros((4, 99), np.float32)

    def truncated(name):
        directory = d(name)
        path = directory / "adapter_model.safetensors"
        path.write_bytes(path.read_bytes()[:-50])
        return directory

    def bad_config(name):
        directory = d(name)
        (directory / "adapter_config.json").write_text("{oops")
        return directory

    def with_bin(name):
        directory = d(name)
        (directory / "adapter_model.bin").write_bytes(b"\x80\x04\x95pickle")
        return directory

    return {
        "pickle .bin": (with_bin("bin"), "adapter_model.bin is a pickle file"),
        "bad config": (bad_config("cfg"), "adapter_config.json is not valid JSON"),
        "DoRA": (d("dora", config=peft_config(use_dora=True)), "DoRA adapters are not supported"),
        "modules_to_save": (d("mts", config=peft_config(modules_to_save=["lm_head"])), "modules_to_save"),
        "rank over max": (d("rank", rank=16, config=peft_config(r=16)), "r = 16 is above max_lora_rank = 8"),
        "unsupported module": (d("mod", config=peft_config(target_modules=["embed_tokens"])), "not a supported target module"),
        "wrong shapes": (d("shape", edit=wrong_shape), "has shape [4, 99]"),
        "NaN": (d("nan", edit=poison(np.nan)), "contains NaN values"),
        "Inf": (d("inf", edit=poison(np.inf)), "contains Inf values"),
        "other base model": (
            d("base", config=peft_config(base_model_name_or_path="meta-llama/Llama-3.1-8B")), "names a different model"
        ),
        "truncated safetensors": (truncated("trunc"), "adapter_model.safetensors is corrupt or truncated"),
    }


BAD_ADAPTERS = ["pickle .bin", "bad config", "DoRA", "modules_to_save", "rank over max", "unsupported module",
                "wrong shapes", "NaN", "Inf", "other base model", "truncated safetensors"]


@pytest.fixture
def good_version(adapter, member, tmp_path, django_capture_on_commit_callbacks) -> AdapterVersion:
    with django_capture_on_commit_callbacks(execute=True):
        version = adapter_version_upload(adapter=adapter, files=two_files(write_peft(tmp_path / "good", seed=7)),
                                         actor=member)
    version.refresh_from_db()
    assert version.status == "ready"
    return version


def assert_rejected_and_nothing_else_changed(good_version, storage_root, reason) -> None:
    bad = AdapterVersion.objects.exclude(pk=good_version.pk).get()
    assert bad.status == "rejected"
    assert any(reason in r for r in bad.rejection_reasons), bad.rejection_reasons
    assert all(isinstance(r, str) for r in bad.rejection_reasons)
    assert not (storage_root / bad.storage_dir).exists()  # its files are gone
    assert stored_files(storage_root) == [
        f"{good_version.storage_dir}/adapter_config.json", f"{good_version.storage_dir}/adapter_model.safetensors",
    ]  # fmt: skip
    resolved = adapter_version_resolve(tenant=good_version.adapter.tenant, model="acme/bot")
    assert resolved.version == good_version
    assert adapter_version_resolve(tenant=good_version.adapter.tenant, model=f"acme/bot@v{bad.number}") is None
    assert AuditEvent.objects.filter(action="version.rejected", target=bad.public_id).exists()


@pytest.mark.parametrize("kind", BAD_ADAPTERS)
def test_bad_adapters_are_rejected_with_their_reason(
    api, good_version, tmp_path, storage_root, django_capture_on_commit_callbacks, kind
) -> None:
    directory, reason = _bad_adapters(tmp_path)[kind]
    response = post(api, [upload("bad.zip", zip_dir(directory))], django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    assert_rejected_and_nothing_else_changed(good_version, storage_root, reason)
    body = api.get(f"{URL}2/").json()
    assert body["status"] == "rejected" and any(reason in r for r in body["rejection_reasons"])


def _malicious(tmp_path):
    good = write_peft(tmp_path / "m")
    config = (good / "adapter_config.json").read_bytes()
    weights = (good / "adapter_model.safetensors").read_bytes()
    return {
        "zip ../ path": ("x.zip", zip_bytes({"../adapter_config.json": config, "adapter_model.safetensors": weights}),
                         "path traversal"),
        "zip absolute path": ("x.zip", zip_bytes({"/tmp/adapter_config.json": config}), "absolute path"),
        "zip symlink": ("x.zip", zip_symlink("adapter_model.safetensors", "/etc/passwd"), "symbolic link"),
        "tar symlink": ("x.tar.gz", tar_bytes([tar_file("adapter_config.json", config),
                                               tar_special("adapter_model.safetensors", tarfile.SYMTYPE, "/etc/passwd")]),
                        "symbolic link"),
        "tar hard link": ("x.tar.gz", tar_bytes([tar_file("adapter_config.json", config),
                                                 tar_special("adapter_model.safetensors", tarfile.LNKTYPE, "/etc/shadow")]),
                          "hard link"),
        "tar device file": ("x.tgz", tar_bytes([tar_special("dev", tarfile.CHRTYPE)]), "device file"),
        "too many files": ("x.zip", zip_bytes({f"f{i}": b"x" for i in range(70)}), "at most 64 are accepted"),
        "zip bomb (declared size)": ("x.zip", zip_bytes({"adapter_model.safetensors": bytes(3 << 20)}), "zip bomb"),
        "zip bomb (actual size)": ("x.zip", zip_lying_about_size("adapter_model.safetensors", bytes(1 << 20), 64), ""),
        "not an archive": ("x.zip", b"garbage", "not a valid zip archive"),
        "empty archive": ("x.zip", zip_bytes({}), "missing adapter_config.json"),
    }


MALICIOUS = ["zip ../ path", "zip absolute path", "zip symlink", "tar symlink", "tar hard link", "tar device file",
             "too many files", "zip bomb (declared size)", "zip bomb (actual size)", "not an archive", "empty archive"]


@pytest.mark.parametrize("kind", MALICIOUS)
def test_malicious_archives_are_rejected(
    api, good_version, tmp_path, storage_root, settings, django_capture_on_commit_callbacks, kind
) -> None:
    settings.ADAPTER_MAX_EXTRACTED_BYTES = 2 << 20
    name, data, reason = _malicious(tmp_path)[kind]
    response = post(api, [upload(name, data)], django_capture_on_commit_callbacks)
    assert response.status_code == 202, response.json()
    assert_rejected_and_nothing_else_changed(good_version, storage_root, reason)
    assert not (tmp_path.parent / "adapter_config.json").exists()


def test_a_duplicate_of_a_ready_version_is_rejected(
    api, good_version, tmp_path, storage_root, django_capture_on_commit_callbacks
) -> None:
    same = write_peft(tmp_path / "same", seed=7)  # byte-identical to good_version, sent as a zip
    post(api, [upload("same.zip", zip_dir(same))], django_capture_on_commit_callbacks)
    assert_rejected_and_nothing_else_changed(good_version, storage_root, f"identical to acme/bot@v1 (sha256 {good_version.sha256})")


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        ([], "the upload is empty"),
        (["adapter_config.json", "adapter_model.bin"], "adapter_model.bin is a pickle file"),
        (["adapter_model.safetensors"], "upload the two PEFT files"),
        (["a.rar"], "upload the two PEFT files"),
        (["adapter_config.json", "adapter_model.safetensors", "x.zip"], "upload the two PEFT files"),
    ],
)
def test_the_shape_of_an_upload_is_checked_at_the_edge(api, adapter, storage_root, names, reason) -> None:
    response = api.post(URL, {"files": [upload(n, b"{}") for n in names]}, format="multipart")
    assert response.status_code == 400 and reason in response.json()["detail"], response.json()
    assert response.json()["field"] == "files"
    assert not AdapterVersion.objects.exists() and stored_files(storage_root) == []


def test_a_zero_byte_file_is_refused(api, adapter, storage_root) -> None:
    files = [upload("adapter_config.json", b"{}"), upload("adapter_model.safetensors", b"")]
    response = api.post(URL, {"files": files}, format="multipart")
    assert response.status_code == 400 and "adapter_model.safetensors is empty" in response.json()["detail"]


def test_not_multipart(api, adapter) -> None:
    response = api.post(URL, {"files": "x"}, format="json")
    assert response.status_code == 415 and "multipart/form-data" in response.json()["detail"]


def test_version_numbers_are_never_reused(adapter, member, tmp_path) -> None:
    from portal.adapters.services import adapter_version_retire

    for seed in range(2):
        version = adapter_version_upload(
            adapter=adapter, files=two_files(write_peft(tmp_path / f"a{seed}", seed=seed)), actor=member
        )
    adapter_version_retire(version=version, actor=member)
    version = adapter_version_upload(adapter=adapter, files=two_files(write_peft(tmp_path / "b", seed=9)), actor=member)
    assert version.number == 3


def test_a_version_retired_or_deleted_while_validating_is_left_alone(
    adapter, member, tmp_path, monkeypatch, storage_root, django_capture_on_commit_callbacks
) -> None:
    from portal.adapters.services import adapter_delete, adapter_version_retire

    version = adapter_version_upload(adapter=adapter, files=[upload("a.zip", zip_dir(write_peft(tmp_path / "a")))],
                                     actor=member)
    real = services._validate_stored

    def retire_midway(v, tmp, base):
        outcome = real(v, tmp, base)  # stores the extracted files
        adapter_version_retire(version=v, actor=member)
        return outcome

    monkeypatch.setattr("portal.adapters.services._validate_stored", retire_midway)
    with django_capture_on_commit_callbacks(execute=True):
        assert adapter_version_validate(version_id=version.id) is None
    version.refresh_from_db()
    assert version.status == "retired" and stored_files(storage_root) == []

    other = adapter_version_upload(adapter=adapter, files=two_files(write_peft(tmp_path / "b", seed=2)), actor=member)

    def delete_midway(v, tmp, base):
        outcome = real(v, tmp, base)
        adapter_delete(adapter=adapter, actor=member)
        return outcome

    monkeypatch.setattr("portal.adapters.services._validate_stored", delete_midway)
    with django_capture_on_commit_callbacks(execute=True):
        assert adapter_version_validate(version_id=other.id) is None
    assert not AdapterVersion.objects.exists() and stored_files(storage_root) == []

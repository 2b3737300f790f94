"""The local backend: paths and file:// URIs, atomic writes, errors for unusable folders."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from sexpgpu.errors import StorageError
from sexpgpu_local.backend import TEMP_PREFIX, LocalStorage

_ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def test_file_uri_and_plain_path_are_the_same_folder(tmp_path):
    plain = LocalStorage(str(tmp_path / "run"))
    plain.write("step-00000001/state.json", b"{}")
    uri = LocalStorage((tmp_path / "run").as_uri())
    assert uri.list_children() == ["step-00000001"]
    assert uri.read("step-00000001/state.json") == b"{}"
    assert uri.root == plain.root


def test_file_uri_on_another_host_is_refused():
    with pytest.raises(StorageError, match="must be on this machine"):
        LocalStorage("file://server/share/run")


def test_check_writable_leaves_the_location_as_it_found_it(tmp_path):
    store = LocalStorage(str(tmp_path / "a" / "b" / "run"))
    store.check_writable()  # the folders it made for its probe are gone again
    assert os.listdir(tmp_path) == []
    store.write("step-00000001/state.json", b"{}")  # a checkpoint's write makes them
    assert os.listdir(tmp_path / "a" / "b" / "run") == ["step-00000001"]
    store.check_writable()  # a folder that was there stays, with what it holds
    assert os.listdir(tmp_path / "a" / "b" / "run") == ["step-00000001"]


def test_a_file_in_the_way_cannot_be_listed(tmp_path):
    (tmp_path / "run").write_bytes(b"not a folder")
    store = LocalStorage(str(tmp_path / "run"))
    with pytest.raises(StorageError) as info:
        store.list_children()
    assert info.value.code == "E-STORAGE-004"
    assert str(info.value).startswith("E-STORAGE-004: cannot list")
    with pytest.raises(StorageError) as info:
        store.check_writable()
    assert info.value.code == "E-STORAGE-004"


def _without_file_capabilities(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python child that file permissions bind, even as root.

    CI runs as root, which reads and writes any folder; the child drops every
    capability (``setpriv``) so a mode of 0 or 0o555 refuses it as it would a user.
    """
    command = [sys.executable, "-c", code]
    if _ROOT:
        command = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_an_unreadable_folder_cannot_be_listed(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0)
    try:
        child = _without_file_capabilities(
            "from sexpgpu.errors import StorageError\n"
            "from sexpgpu_local.backend import LocalStorage\n"
            "try:\n"
            f"    LocalStorage({str(folder)!r}).list_children()\n"
            "except StorageError as exc:\n"
            "    print(exc.code)\n"
        )
    finally:
        folder.chmod(0o755)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "E-STORAGE-004"


def test_every_call_below_a_folder_that_cannot_be_searched_is_a_storage_error(tmp_path):
    # A step folder without permissions, under a location that lists: each call on a
    # file in it says what it could not do, with a code, never an OSError.
    store = LocalStorage(str(tmp_path / "run"))
    store.write("step-00000001/experiment.json", b"{}")
    (tmp_path / "run" / "step-00000001").chmod(0)
    try:
        child = _without_file_capabilities(
            "from sexpgpu.errors import StorageError\n"
            "from sexpgpu_local.backend import LocalStorage\n"
            f"store = LocalStorage({str(tmp_path / 'run')!r})\n"
            "print(store.list_children())\n"
            "key = 'step-00000001/experiment.json'\n"
            "for call in (store.exists, store.read, store.identity, store.delete,\n"
            "             lambda k: store.write(k, b'{}'),\n"
            "             lambda k: store.list_children('step-00000001/x')):\n"
            "    try:\n"
            "        call(key)\n"
            "    except StorageError as exc:\n"
            "        print(exc)\n"
        )
    finally:
        (tmp_path / "run" / "step-00000001").chmod(0o755)
    assert child.returncode == 0, child.stderr
    where = f"{tmp_path / 'run'}/step-00000001"
    assert child.stdout.splitlines() == [
        "['step-00000001']",
        *[f"E-STORAGE-002: cannot read {where}/experiment.json: Permission denied"] * 3,
        f"E-STORAGE-002: cannot delete {where}/experiment.json: Permission denied",
        f"E-STORAGE-002: cannot write {where}/experiment.json: Permission denied",
        f"E-STORAGE-004: cannot list {where}/x: Permission denied",
    ]
    assert store.read("step-00000001/experiment.json") == b"{}"


def test_a_failed_write_keeps_the_old_bytes(tmp_path):
    store = LocalStorage(str(tmp_path / "run"))
    store.write("state.json", b"old")
    (tmp_path / "run").chmod(0o555)
    try:
        child = _without_file_capabilities(
            "from sexpgpu.errors import StorageError\n"
            "from sexpgpu_local.backend import LocalStorage\n"
            "try:\n"
            f"    LocalStorage({str(tmp_path / 'run')!r}).write('state.json', b'new')\n"
            "except StorageError as exc:\n"
            "    print(exc.code)\n"
        )
    finally:
        (tmp_path / "run").chmod(0o755)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "E-STORAGE-002"
    assert store.read("state.json") == b"old"


def test_a_write_into_a_file_fails_cleanly(tmp_path):
    store = LocalStorage(str(tmp_path / "run"))
    store.write("step-00000001", b"a file where a folder should be")
    with pytest.raises(StorageError) as info:
        store.write("step-00000001/state.json", b"{}")
    assert info.value.code == "E-STORAGE-005"
    assert "\n" not in str(info.value)


def test_temp_files_are_never_listed(tmp_path):
    store = LocalStorage(str(tmp_path / "run"))
    store.write("step-00000001/params.safetensors", b"x" * 100)
    # What a write cut off by SIGKILL leaves behind.
    (tmp_path / "run" / "step-00000001" / f"{TEMP_PREFIX}state.json-dead").write_bytes(b"{")
    assert store.list_children("step-00000001") == ["params.safetensors"]
    assert not store.exists("step-00000001/state.json")


def test_write_leaves_no_temp_files(tmp_path):
    store = LocalStorage(str(tmp_path / "run"))
    store.write_many({f"step-00000001/f{i}": os.urandom(10_000) for i in range(6)})
    assert sorted(os.listdir(tmp_path / "run" / "step-00000001")) == [f"f{i}" for i in range(6)]


def test_a_killed_writer_leaves_old_or_new_bytes(tmp_path):
    # A child rewrites one file in a loop and is SIGKILLed at some point; whatever that
    # point was, the file holds one whole version, never a torn mix.
    target = tmp_path / "run"
    code = (
        "import sys; from sexpgpu_local.backend import LocalStorage\n"
        f"s = LocalStorage({str(target)!r})\n"
        "s.write('f', b'A' * (8 << 20)); print('ready', flush=True)\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1; s.write('f', bytes([65 + i % 26]) * (8 << 20))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"ready"
    child.kill()
    child.wait()
    data = (target / "f").read_bytes()
    assert len(data) == 8 << 20
    assert data == data[:1] * len(data)
    assert LocalStorage(str(target)).list_children() == ["f"]


def test_delete_prunes_empty_folders_but_not_the_location(tmp_path):
    store = LocalStorage(str(tmp_path / "run"))
    store.write("step-00000001/deep/x", b"1")
    store.delete("step-00000001/deep/x")
    assert (tmp_path / "run").is_dir()
    assert os.listdir(tmp_path / "run") == []


def test_keys_cannot_leave_the_location(tmp_path):
    store = LocalStorage(str(tmp_path / "run"))
    with pytest.raises(StorageError):
        store.write("../outside", b"x")
    assert not (tmp_path / "outside").exists()


def test_identity_is_the_sha256_of_the_bytes(tmp_path):
    data = os.urandom(9 << 20)  # more than one hashing chunk
    store = LocalStorage(str(tmp_path / "run"))
    store.write("f", data)
    identity = store.identity("f")
    assert identity.size == len(data)
    assert identity.version == "sha256:" + hashlib.sha256(data).hexdigest()

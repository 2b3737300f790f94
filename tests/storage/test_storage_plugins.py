"""The storage plugins as the core finds them: schemes, lazy imports, missing libraries."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_importing_the_plugins_imports_no_heavy_library():
    code = (
        "import sys, sexpgpu_local, sexpgpu_s3, sexpgpu_gcs\n"
        "for m in (sexpgpu_local, sexpgpu_s3, sexpgpu_gcs): m.sexpgpu_storage_backends()\n"
        "heavy = [m for m in ('boto3', 'botocore', 'google.cloud.storage', 'torch') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_plugins_serve_their_schemes(tmp_path):
    from sexpgpu.catalog import Catalog

    open_location = Catalog.load().open_location
    assert type(open_location(str(tmp_path))).__name__ == "LocalStorage"
    assert type(open_location(tmp_path.as_uri())).__name__ == "LocalStorage"
    assert type(open_location("s3://bucket/prefix")).__name__ == "S3Storage"
    assert type(open_location("gs://bucket/prefix")).__name__ == "GcsStorage"


HIDE = textwrap.dedent(
    """
    import sys

    class Hide:
        # Makes a library look uninstalled, as on a machine without the extra.
        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names or name.startswith("google.cloud"):
                raise ModuleNotFoundError(name)
            return None

    sys.meta_path.insert(0, Hide({hidden!r}))
    """
)


@pytest.mark.parametrize(
    ("uri", "hidden", "plugin", "hint"),
    [
        ("s3://bucket/run", ["boto3"], "s3", "pip install 'sexpgpu[s3]'"),
        ("gs://bucket/run", ["google"], "gcs", "pip install 'sexpgpu[gcs]'"),
    ],
)
def test_a_missing_library_makes_the_plugin_unavailable_with_its_hint(uri, hidden, plugin, hint):
    code = HIDE.format(hidden=hidden) + textwrap.dedent(
        f"""
        from sexpgpu.catalog import Catalog
        from sexpgpu.errors import PluginError

        catalog = Catalog.load()
        open_location = catalog.open_location
        record = catalog.record({plugin!r})
        print(record.available, record.reason)
        try:
            open_location({uri!r})
        except PluginError as exc:
            print(exc)
        print(type(open_location("/tmp/x")).__name__)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("False ") and hint in lines[0]
    assert f"needs the plugin '{plugin}', which is unavailable" in lines[1]
    assert hint in lines[1]
    assert lines[2] == "LocalStorage"  # the other backends are untouched

"""A third-party plugin, installed only on PYTHONPATH, adds a storage scheme and a CLI
command, and both work through ``sexpgpu`` without any change to the project."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .pluginkit import hooks_line, make_mem_plugin, plugin_line, run_python, run_sexpgpu


@pytest.fixture
def mem(tmp_path: Path) -> dict:
    """The mem:// plugin installed in a temp folder, and where its objects go."""
    site = make_mem_plugin(tmp_path / "site")
    store = tmp_path / "objects"
    store.mkdir()
    return {"pythonpath": [site], "MEM_PLUGIN_ROOT": str(store), "cwd": tmp_path, "store": store}


def _sexpgpu(mem: dict, *args: str, **env: str):
    return run_sexpgpu(
        list(args),
        cwd=mem["cwd"],
        pythonpath=mem["pythonpath"],
        MEM_PLUGIN_ROOT=mem["MEM_PLUGIN_ROOT"],
        **env,
    )


def test_plugin_command_appears_in_help_and_runs(mem: dict) -> None:
    """sexpgpu_cli_commands: the plugin's `mem` group is listed by --help and works."""
    result = _sexpgpu(mem, "--help")
    assert result.returncode == 0, result.stderr
    commands = result.stdout.split("Commands:", 1)[1]
    assert any(line.split()[:1] == ["mem"] for line in commands.splitlines())
    assert "plugins" in commands

    put = _sexpgpu(mem, "mem", "put", "mem://bucket/run", "step-1/meta.json", "hello")
    assert put.returncode == 0, put.stderr
    # the object really went where the plugin keeps it, and a new process reads it back
    assert (mem["store"] / "bucket/run/step-1/meta.json").read_text() == "hello"
    got = _sexpgpu(mem, "mem", "get", "mem://bucket/run", "step-1/meta.json")
    assert got.returncode == 0, got.stderr
    assert got.stdout == "hello\n"


def test_plugin_storage_error_is_one_line(mem: dict) -> None:
    """A StorageError raised inside a plugin's command reaches the user as one line."""
    result = _sexpgpu(mem, "mem", "get", "mem://bucket/run", "missing.json")
    assert result.returncode == 1
    assert result.stderr == "sexpgpu mem: mem://bucket/run/missing.json: no such object\n"


def test_without_the_plugin_nothing_changes(tmp_path: Path) -> None:
    """The plugin is installed only for processes that see its folder."""
    listing = run_sexpgpu(["plugins", "--json"], cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "mem" not in {p["name"] for p in json.loads(listing.stdout)}
    help_ = run_sexpgpu(["mem", "--help"], cwd=tmp_path)
    assert help_.returncode == 2
    assert "No such command 'mem'" in help_.stderr


def test_plugins_lists_the_third_party_plugin(mem: dict) -> None:
    """`sexpgpu plugins` shows name, distribution, version, module and hooks."""
    result = _sexpgpu(mem, "plugins")
    assert result.returncode == 0, result.stderr
    line = plugin_line(result.stdout, "mem")
    assert "sexpgpu-mem-plugin 0.1" in line
    assert "(sexpgpu_mem_plugin)" in line
    assert line.endswith("available")
    assert hooks_line(result.stdout, "mem") == "hooks: cli_commands, storage_backends"
    lines = result.stdout.splitlines()
    at = lines.index(line)
    assert [text.strip() for text in lines[at + 2 : at + 4]] == [
        "storage mem://: objects in a folder",
        "command mem: Put and get objects in mem:// locations (a test plugin).",
    ]

    as_json = _sexpgpu(mem, "plugins", "--json")
    assert as_json.returncode == 0, as_json.stderr
    records = {p["name"]: p for p in json.loads(as_json.stdout)}
    assert records["mem"] == {
        "name": "mem",
        "module": "sexpgpu_mem_plugin",
        "distribution": "sexpgpu-mem-plugin",
        "version": "0.1",
        "hooks": ["sexpgpu_cli_commands", "sexpgpu_storage_backends"],
        "available": True,
        "refused": False,
        "disabled": False,
        "reason": None,
        "warnings": [],
        "traceback": None,
        "supplies": {
            "storage_backends": [
                {"title": "mem://", "schemes": ["mem"], "doc": "objects in a folder"}
            ],
            "cli_commands": [
                {
                    "title": "mem",
                    "name": "mem",
                    "doc": "Put and get objects in mem:// locations (a test plugin).",
                }
            ],
        },
        "conflicts": [],
    }
    # the built-in plugins are still there, found the same way
    assert {"local", "torch"} <= set(records)


def test_open_location_uses_the_plugin_storage(mem: dict) -> None:
    """sexpgpu_storage_backends: the catalog's open_location("mem://x") returns the
    plugin's Storage, and every Storage operation round-trips."""
    code = """
        from sexpgpu.catalog import Catalog
        from sexpgpu.checkpoint.storage import scheme_of

        store = Catalog.load().open_location("mem://x/")
        print(store.describe(), store.uri, scheme_of("mem://x"))
        store.check_writable()
        store.write("a/b.bin", b"0123456789")
        store.write_many({"a/c.bin": b"c", "d.json": memoryview(b"{}")})
        assert store.read("a/b.bin") == b"0123456789"
        assert store.read_range("a/b.bin", 3, 4) == b"3456"
        assert store.read_range("a/b.bin", 8, 10) == b"89"
        assert store.list_children() == ["a", "d.json"], store.list_children()
        assert store.list_children("a") == ["b.bin", "c.bin"]
        ident = store.identity("a/b.bin")
        assert ident.size == 10 and ident.version.startswith("sha256:"), ident
        store.delete("a/c.bin")
        store.delete("a/c.bin")
        assert not store.exists("a/c.bin") and store.exists("a/b.bin")
        print("round-trip ok")
    """
    result = run_python(
        code, cwd=mem["cwd"], pythonpath=mem["pythonpath"], MEM_PLUGIN_ROOT=mem["MEM_PLUGIN_ROOT"]
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "mem://x (mem test plugin, no credentials) mem://x mem",
        "round-trip ok",
    ]


def test_plugins_says_what_the_builtin_plugins_supply(tmp_path: Path) -> None:
    """Schemes, sinks, data sources with their options, kernels with their kind and
    determinism, optimizers with their options, lowerings with their devices; each
    with its doc line, in the listing and in --json."""
    listing = run_sexpgpu(["plugins"], cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    out = listing.stdout.splitlines()
    for expected in (
        "storage file://: a local or mounted folder: /path, ./path or file:///path",
        "lowering torch (devices cpu, cuda): PyTorch eager execution of a compiled program "
        "(CPU, CUDA)",
        "kernel attention:math (torch lowering; devices cpu, cuda; deterministic; priority 0): "
        "softmax(QK^T/sqrt(d))V written out, causal mask by masked_fill",
        "kernel attention:sdpa (torch lowering; devices cpu, cuda; non-deterministic; "
        "priority 10): torch.nn.functional.scaled_dot_product_attention",
        "optimizer sgd (lr=0.01, momentum=0.0, weight_decay=0.0, nesterov=False): "
        "stochastic gradient descent; state 'momentum' when momentum > 0",
    ):
        assert expected in [line.strip() for line in out], expected
    assert any(
        line.strip().startswith("data source tokens (path='', dtype='uint16'): ") for line in out
    )
    assert any(line.strip().startswith("metrics sink jsonl: ") for line in out)

    records = {
        r["name"]: r for r in json.loads(run_sexpgpu(["plugins", "--json"], cwd=tmp_path).stdout)
    }
    torch = records["torch"]["supplies"]
    assert {"lowerings", "kernels", "optimizers"} <= set(torch)
    math = next(k for k in torch["kernels"] if k["name"] == "math")
    assert math == {
        "title": "attention:math",
        "kind": "attention",
        "name": "math",
        "lowering": "torch",
        "devices": ["cpu", "cuda"],
        "deterministic": True,
        "priority": 0,
        "doc": "softmax(QK^T/sqrt(d))V written out, causal mask by masked_fill",
    }
    adamw = next(o for o in torch["optimizers"] if o["name"] == "adamw")
    assert adamw["options"]["no_decay_tags"] == ["no-decay"] and adamw["doc"]
    tokens = next(d for d in records["data"]["supplies"]["data_sources"] if d["name"] == "tokens")
    assert tokens["options"] == {"path": "", "dtype": "uint16"}
    assert set(tokens["option_docs"]) == {"path", "dtype"}
    assert records["jsonl"]["supplies"]["metrics_sinks"][0]["name"] == "jsonl"
    assert records["local"]["supplies"]["storage_backends"][0]["schemes"] == ["file"]
    # every built-in says what each thing is for
    for record in records.values():
        for items in record["supplies"].values():
            assert all(item["doc"] for item in items), (record["name"], items)

"""Optional abilities are declared members of the protocols, with defaults, never found
by asking an object what it has (issue 52, item 5).

The core and the built-in plugins hold no ``getattr``/``hasattr``/``inspect.signature``
probe of an object a plugin built, but for the few legitimate uses listed below, each
with its reason. An object that does not subclass its protocol gets the defaults it
lacks where the core takes it from its plugin (``sexpgpu.extension.with_defaults``): a
third party's trainer and storage backend with none of the optional members train,
checkpoint and resume to the bit. Error codes are compared as constants, never looked
for in a message's text."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import sexpgpu_torch
from sexpgpu.catalog import Catalog
from sexpgpu.extension import (
    E_GROUP,
    OPTIONAL,
    DataLoader,
    LoweringInfo,
    MetricsSink,
    OptimizerUpdate,
    Storage,
    StorageBackendInfo,
    Trainer,
    with_defaults,
)
from sexpgpu.hookspecs import hookimpl
from sexpgpu.session import Selection, Target
from sexpgpu.train import RunOptions, run
from sexpgpu_local.backend import LocalStorage

from .pluginkit import REPO
from .test_catalog import EXAMPLES, OURS, no_entry_points  # noqa: F401 (a fixture)

SCANNED = ("core", "cli", "plugins", "storage_backends")
PROBES = {"getattr", "hasattr", "signature", "getattr_static"}

# Each legitimate look-up by name, by file and the call as written, with its reason.
# None of them asks a plugin's object which optional ability it has.
ALLOWED: dict[tuple[str, str], str] = {
    # the boundary: an object taken from its plugin gets its protocol's defaults, once
    ("core/sexpgpu/extension.py", "hasattr(inner, name)"): "with_defaults: what it lacks",
    ("core/sexpgpu/extension.py", "getattr(self._inner, name)"): "with_defaults: delegation",
    ("core/sexpgpu/lang/contracts.py", "hasattr(value, f.name)"): "a stand-in as its descriptor",
    ("core/sexpgpu/lang/contracts.py", "getattr(value, f.name)"): "a stand-in as its descriptor",
    ("core/sexpgpu/lang/contracts.py", "hasattr(value, name)"): "whether it stands in at all",
    ("core/sexpgpu/session.py", "hasattr(trainer, name)"): "the required members a trainer lacks",
    # a refused plugin's op spec may be anything: described and claimed as far as it goes
    ("core/sexpgpu/lang/contracts.py", 'getattr(spec, "surfaces", None)'): "a broken op spec",
    ("cli/sexpgpu_cli/describing.py", 'getattr(spec, "keywords", ())'): "a broken op spec",
    ("cli/sexpgpu_cli/describing.py", 'getattr(info.spec, "surfaces", ())'): "a broken op spec",
    # a dataclass's own fields, by their declared names
    ("core/sexpgpu/checkpoint/hashing.py", "getattr(before, f)"): "os.stat_result's fields",
    ("core/sexpgpu/checkpoint/hashing.py", "getattr(after, f)"): "os.stat_result's fields",
    ("core/sexpgpu/lang/optable.py", "getattr(spec, f.name)"): "an OpSpec's fields",
    ("core/sexpgpu/plugin_supplies.py", "getattr(info, spec.name)"): "a descriptor's fields",
    ("cli/sexpgpu_cli/commands/plugins.py", "getattr(record, name)"): "a PluginRecord's fields",
    # the core's own objects (IR nodes, values, compiled programs, a batch's arrays)
    ("core/sexpgpu/lang/graphs.py", 'getattr(node, "items", None)'): "a list node or an atom",
    ("core/sexpgpu/lang/optable.py", 'getattr(arg, "pos", None)'): "an infer call's arguments",
    ("core/sexpgpu/lang/text.py", 'getattr(value, "shown", None)'): "a value as written",
    ("core/sexpgpu/batches.py", 'getattr(first, "shape", ())'): "an array or a scalar",
    ("plugins/sexpgpu_eval/session.py", 'getattr(program, "evals", ())'): "a compiled Program",
    # modules, and the hook specifications
    ("core/sexpgpu/log.py", "getattr(logging, level.upper(), logging.INFO)"): "a level",
    ("core/sexpgpu/catalog.py", 'getattr(plugin, "__name__", type(plugin).__name__)'): "its name",
    ("core/sexpgpu/lang/contracts.py", 'hasattr(obj, f"{hookspecs.PROJECT}_spec")'): "hookspecs",
    ("core/sexpgpu/lang/contracts.py", "getattr(hookspecs, hook)"): "a hook's specification",
    ("core/sexpgpu/lang/contracts.py", 'getattr(declared, "__name__", str(declared))'): "a type",
    ("cli/sexpgpu_cli/group.py", "getattr(importlib.import_module(module_name), attr)"): "lazy",
    ("plugins/sexpgpu_cuda/__init__.py", "getattr(kernels, name)"): "a lazy module attribute",
    ("plugins/sexpgpu_torch/__init__.py", "getattr(kernels, name)"): "a lazy module attribute",
    ("plugins/sexpgpu_data/__init__.py", "getattr(_common, name)"): "a lazy module attribute",
    ("plugins/sexpgpu_data/__init__.py", 'getattr(import_module(f"{__name__}.{module}"), name)'): (
        "a lazy module attribute"
    ),
    ("cli/sexpgpu_cli/main.py", 'getattr(sys, "last_exc", None)'): "Python 3.12's, or not",
    ("cli/sexpgpu_cli/main.py", 'getattr(sys, "last_value", None)'): "Python 3.12's, or not",
    ("cli/sexpgpu_cli/main.py", 'getattr(group, "LazyGroup", None)'): "the CLI's own module",
    ("cli/sexpgpu_cli/main.py", 'getattr(getattr(group, "LazyGroup", None), "invoked", None)'): (
        "the CLI's own class"
    ),
    # the platform's flags and the libraries' versions (Python, importlib, torch, clients)
    ("plugins/sexpgpu_bundle/archive.py", 'getattr(os, "O_NOFOLLOW", 0)'): "a POSIX flag",
    ("plugins/sexpgpu_bundle/scratch.py", 'getattr(os, "O_NOFOLLOW", 0)'): "a POSIX flag",
    ("plugins/sexpgpu_jsonl/sink.py", 'getattr(os, "O_CLOEXEC", 0)'): "a POSIX flag",
    ("plugins/sexpgpu_report/fields.py", 'getattr(os, "O_CLOEXEC", 0)'): "a POSIX flag",
    ("storage_backends/sexpgpu_local/backend.py", 'getattr(os, "O_CLOEXEC", 0)'): "a POSIX flag",
    ("core/sexpgpu/catalog.py", 'getattr(entry_point, "dist", None)'): "importlib's version",
    ("plugins/sexpgpu_torch/compiled.py", 'hasattr(functorch_config, "enable_autograd_cache")'): (
        "torch's version"
    ),
    ("plugins/sexpgpu_torch/cuda.py", 'hasattr(inductor_config, "deterministic")'): "torch's",
    ("plugins/sexpgpu_torch/launcher.py", 'getattr(LaunchConfig, "__dataclass_fields__", {})'): (
        "torch's version"
    ),
    ("plugins/sexpgpu_torch/isa_probe.py", 'getattr(cpu_vec_isa.VecISA, "_probe_load", None)'): (
        "torch's internals"
    ),
    ("plugins/sexpgpu_torch/isa_probe.py", 'getattr(probe, "remembered", False)'): "its own mark",
    ("plugins/sexpgpu_torch/mkl.py", "getattr(handle, get_name, None)"): "MKL's library",
    ("plugins/sexpgpu_torch/mkl.py", "getattr(handle, set_name, None)"): "MKL's library",
    ("storage_backends/sexpgpu_gcs/backend.py", 'getattr(inner, "reason", None)'): "an exception",
    ("storage_backends/sexpgpu_gcs/backend.py", "getattr(exc, 'strerror', None)"): "an exception",
    ("storage_backends/sexpgpu_s3/backend.py", 'getattr(credentials, "method", None)'): "botocore",
    # the torch plugin's own objects: its modules' parameters, its slots, its own closures
    ("plugins/sexpgpu_torch/placement/replicated.py", 'getattr(holder, f"p{i}")'): "its module",
    ("plugins/sexpgpu_torch/placement/fully_sharded.py", 'getattr(self, f"p{i}")'): "its module",
    ("plugins/sexpgpu_torch/placement/fully_sharded.py", 'getattr(module, f"p{i}")'): "its module",
    ("plugins/sexpgpu_torch/placement/fully_sharded.py", 'getattr(slots, "iteration", 0)'): (
        "its slots, or a plain list"
    ),
    ("plugins/sexpgpu_torch/kernels.py", 'getattr(slots, "iteration", 0)'): "its slots, or a list",
    ("plugins/sexpgpu_torch/graphs.py", 'getattr(fn, "reads_iteration", False)'): (
        "its own dropout closures' mark"
    ),
}


def probes(source: str, filename: str = "<test>") -> Iterator[tuple[int, str]]:
    """Each ``getattr``/``hasattr``/``inspect.signature``/``getattr_static`` call of a
    source, called by name or as a module's attribute: (line, the call as written)."""
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in PROBES:
            written = ast.get_source_segment(source, node) or ""
            yield node.lineno, " ".join(written.split())


def found_probes() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            where = str(path.relative_to(REPO))
            for line, call in probes(path.read_text(), where):
                found.setdefault((where, call), []).append(line)
    return found


def test_no_plugin_object_is_probed_for_what_it_has() -> None:
    found = found_probes()
    unexplained = [f"{path}:{lines[0]}: {call}" for (path, call), lines in found.items()]
    unexplained = [u for u, key in zip(unexplained, found, strict=True) if key not in ALLOWED]
    assert unexplained == [], (
        "declare an optional member on its protocol, with a default, and use it "
        "(sexpgpu.extension.OPTIONAL); a legitimate use goes into ALLOWED with its reason"
    )
    # an entry whose call is gone is taken out, so the list stays the few that are left
    assert sorted(set(ALLOWED) - set(found)) == []


def test_the_scan_sees_every_form_of_probe() -> None:
    source = (
        "import inspect\n"
        "from inspect import getattr_static, signature\n"
        "getattr(trainer, 'holds_replicas', True)\n"
        "hasattr(storage, 'read_range_into')\n"
        "inspect.signature(storage.write_many)\n"
        "signature(storage.write_many)\n"
        "getattr_static(loader, 'next_part')\n"
        "trainer.holds_replicas\n"
    )
    assert [line for line, _ in probes(source)] == [3, 4, 5, 6, 7]
    assert (4, "hasattr(storage, 'read_range_into')") in list(probes(source))


# ---------------------------------------------------------------- the declarations


def test_every_optional_member_has_its_default_on_its_protocol_and_in_the_docs() -> None:
    protocols = (REPO / "docs" / "plugins.md").read_text().split("## The protocols")[1]
    protocols = protocols.split("\n## ")[0]
    for protocol, names in OPTIONAL.items():
        for name in names:
            assert name in vars(protocol), f"{protocol.__name__}.{name} has no default"
            assert f"`{name}" in protocols, f"docs/plugins.md does not give {name}"


class _BareStore:
    uri = "bare://x"

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return b"0123456789"[start : start + length]


class _Filling(_BareStore):
    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        buffer[:2] = b"ab"
        return 2


class _Loader:
    def __init__(self) -> None:
        self.taken = 0

    def next_batch(self) -> dict[str, np.ndarray]:
        self.taken += 1
        return {"x": np.arange(6) + 10 * self.taken}


class _Sink:
    def write(self, events: Any) -> None:
        pass


class _Update:
    def init_states(self, params: Any, options: Any) -> dict:
        return {}


def test_an_object_that_does_not_subclass_its_protocol_gets_the_defaults_it_lacks() -> None:
    store = with_defaults(_BareStore(), Storage)
    assert (store.takes_crc32c, store.read_range_into, store.uri) == (False, None, "bare://x")
    assert store.remove_temporaries("step-00000002") is None
    assert store.read_range("k", 2, 3) == b"234"  # its own members, as they are
    # a member it has is its own, never the default
    buffer = bytearray(4)
    assert with_defaults(_Filling(), Storage).read_range_into("k", 0, memoryview(buffer)) == 2
    # a default method is bound to the object: the loader's own next_batch cuts the part
    loader = _Loader()
    part = with_defaults(loader, DataLoader).next_part(1, 3)
    assert part["x"].tolist() == [12, 13] and loader.taken == 1
    assert with_defaults(_Sink(), MetricsSink).name == "_Sink"  # its class's name
    assert with_defaults(_Update(), OptimizerUpdate).elementwise is False
    bare = with_defaults(object(), Trainer)
    assert (bare.reads_loss_late, bare.exports_together) == (False, False)
    assert (bare.holds_replicas, bare.evaluates_together, bare.warm_up()) == (True, False, None)
    with pytest.raises(NotImplementedError, match="one device only"):
        bare.use_group(None)


def test_a_subclass_is_its_own_object_with_the_defaults_it_inherits() -> None:
    class Store(_BareStore, Storage):
        takes_crc32c = True

    store = Store()
    assert with_defaults(store, Storage) is store
    assert (store.takes_crc32c, store.read_range_into) == (True, None)
    loader = _Loader()
    assert with_defaults(loader, DataLoader) is not loader  # seen through the defaults


# ---------------------------------------------------------------- a third party's objects


class BareTrainer:
    """A trainer with only the Trainer protocol's required members (the torch one's), no
    subclass of it: every optional member comes from the protocol's defaults."""

    def __init__(self, inner: Trainer) -> None:
        self._inner = inner
        self.choices = inner.choices

    def init_params(self) -> None:
        self._inner.init_params()

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        self._inner.set_params(params)

    def propose(self, batch: Mapping[str, np.ndarray], *, stage: int, step: int, lr: float):
        return self._inner.propose(batch, stage=stage, step=step, lr=lr)

    def find_non_finite(self, proposal: Any) -> tuple[str, str, int] | None:
        return self._inner.find_non_finite(proposal)

    def commit(self, proposal: Any) -> None:
        self._inner.commit(proposal)

    def export(self, *, reuse: bool = False) -> tuple[dict, dict]:
        return self._inner.export(reuse=reuse)

    def restore(self, params: Any, states: Any, *, stage: int) -> None:
        self._inner.restore(params, states, stage=stage)

    def evaluate(self, pass_name: str, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        return self._inner.evaluate(pass_name, batch)


class BareLowering:
    def lower(self, program: Any, *, device: str, supplies: Any, choices: Any) -> BareTrainer:
        (torch,) = [i for i in sexpgpu_torch.sexpgpu_lowerings() if i.name == "torch"]
        return BareTrainer(
            torch.factory().lower(program, device=device, supplies=supplies, choices=choices)
        )


class BareStorage:
    """The local backend's required members only: no ``takes_crc32c``, no
    ``read_range_into``, no ``remove_temporaries`` (``write_many`` takes no checksums)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._local = LocalStorage(uri.removeprefix("bare://"))

    def describe(self) -> str:
        return f"{self.uri} (bare)"

    def check_writable(self) -> None:
        self._local.check_writable()

    def list_children(self, prefix: str = "") -> list[str]:
        return self._local.list_children(prefix)

    def exists(self, key: str) -> bool:
        return self._local.exists(key)

    def read(self, key: str) -> bytes:
        return self._local.read(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self._local.read_range(key, start, length)

    def write(self, key: str, data: bytes | memoryview) -> None:
        self._local.write(key, data)

    def write_many(self, items: Mapping[str, bytes | memoryview]) -> None:
        self._local.write_many(items)

    def delete(self, key: str) -> None:
        self._local.delete(key)

    def identity(self, key: str) -> Any:
        return self._local.identity(key)


class Bare:
    @hookimpl
    def sexpgpu_lowerings(self) -> list[LoweringInfo]:
        return [LoweringInfo("bare", ("cpu",), BareLowering, default_for=())]

    @hookimpl
    def sexpgpu_storage_backends(self) -> list[StorageBackendInfo]:
        return [StorageBackendInfo(("bare",), BareStorage)]


def _run(catalog: Catalog, folder: Path, lowering: str, **options: Any) -> Any:
    return run(
        RunOptions(
            Selection(str(EXAMPLES / "my-run.sx"), steps=options.pop("steps", None)),
            target=Target(lowering=lowering),
            metrics_dir=str(folder / "m"),
            **options,
        ),
        catalog,
    )


def test_a_bare_trainer_and_storage_train_checkpoint_and_resume_to_the_bit(
    no_entry_points,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    catalog = Catalog.of({**OURS, "bare": Bare()})
    opened = catalog.open_location(f"bare://{tmp_path / 'probe'}")
    assert (opened.takes_crc32c, opened.read_range_into) == (False, None)
    bare = f"bare://{tmp_path / 'bare'}"
    first = _run(catalog, tmp_path, "bare", checkpoint_dir=bare, steps=1)
    assert (first.exit_code, first.step) == (0, 1), first.message
    resumed = _run(catalog, tmp_path, "bare", checkpoint_dir=bare, resume="latest")
    assert (resumed.exit_code, resumed.step) == (0, 4), resumed.message
    whole = _run(catalog, tmp_path, "torch", checkpoint_dir=str(tmp_path / "torch"))
    assert (whole.exit_code, whole.step) == (0, 4), whole.message
    for name in ("params.safetensors", "states.safetensors"):
        ours = load_file(str(tmp_path / "bare" / "step-00000004" / name))
        theirs = load_file(str(tmp_path / "torch" / "step-00000004" / name))
        assert ours.keys() == theirs.keys()
        for key, value in ours.items():
            assert value.tobytes() == theirs[key].tobytes(), key


# ---------------------------------------------------------------- error codes


def test_a_rank_s_line_is_shown_for_the_group_s_code_never_for_its_text(monkeypatch) -> None:
    from sexpgpu_cli.launch import Worker

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SEXPGPU_LAUNCH_DIR", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    worker = Worker(None)
    lost = f"step 3: {E_GROUP}: rank 1 of 2 lost the group while summing"
    assert worker.finish(1, lost, E_GROUP) == (1, lost)
    # a line that only mentions the code is no lost group: rank 0 says it
    assert worker.finish(1, f"step 3: a value named {E_GROUP}", "E-RUN-001") == (1, None)
    assert worker.finish(1, f"step 3: a value named {E_GROUP}") == (1, None)


def test_the_launcher_matches_no_code_in_a_message() -> None:
    source = (REPO / "cli" / "sexpgpu_cli" / "launch.py").read_text()
    assert re.search(r"\"E-[A-Z]+-\d+\" in ", source) is None
    assert "E_GROUP" in source

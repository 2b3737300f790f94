"""Opening a bundle to run it: fetched (a local path, ``s3://`` or ``gs://``), checked
whole, unpacked into a folder of its own, and its versions compared with this
machine's before anything is compiled.

Torch-free: library versions are read from the installed distributions' metadata.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sexpgpu.extension import OpenedSource
from sexpgpu_bundle.archive import (
    DEFAULT_BOUND,
    E_MANIFEST,
    E_TOO_LARGE,
    E_UNSAFE,
    MAX_MANIFEST,
    BundleError,
    extract,
    shown,
)
from sexpgpu_bundle.closed import ClosedWorld

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

E_VERSIONS = "E-BUNDLE-005"
"""A bundle made with another sexpgpu, torch or plugin version than this machine's."""

E_DATA = "E-BUNDLE-007"
"""A data file the bundle recorded (not copied) that is missing or has other bytes."""

E_FETCH = "E-BUNDLE-006"
"""A bundle that cannot be read from where it was named."""

E_MACHINE = "E-BUNDLE-008"
"""A bundle whose compiled kernels and choices were made on another kind of machine."""

PROJECT = "sexpgpu"
"""The distribution whose requirements are the libraries a bundle records."""

SUFFIX = ".sxb"
"""A bundle's file name ends so; ``sexpgpu run`` tells a bundle from a `.sx` file by it."""

_CHUNK = 8 << 20


def is_bundle(name: str) -> bool:
    """Whether ``name`` names a bundle."""
    return name.endswith(SUFFIX)


@dataclass(frozen=True)
class Unpacked:
    """A bundle unpacked into ``folder``: its manifest and the main file's path there."""

    manifest: Mapping[str, Any]
    folder: Path

    @property
    def main(self) -> str:
        """The path of the bundle's main `.sx` file in :attr:`folder`."""
        return str(self.folder / self.manifest["main"])

    # The manifest was checked against its schema (sexpgpu_bundle.archive) before this
    # was made: each field below is of its type and in its range.

    @property
    def sets(self) -> dict[str, str]:
        """The knobs the bundling command line set, as ``--set`` takes them."""
        return dict(self.manifest["selection"]["sets"])

    @property
    def variant(self) -> str | None:
        """The variant the bundle was made with."""
        return self.manifest["selection"]["variant"]

    @property
    def steps(self) -> int | None:
        """``--steps`` as the bundling command line gave it."""
        return self.manifest["selection"]["steps"]

    @property
    def choices(self) -> dict[str, str]:
        """The choices the bundling machine made."""
        return dict(self.manifest["choices"])

    def closed_world(self, name: str) -> ClosedWorld:
        """What the bundle ``name``'s program may read: its own files, and the local
        data files it recorded without copying them."""
        recorded = [e["uri"] for e in self.manifest["data_files"] if e["member"] is None]
        return ClosedWorld.of(name, str(self.folder), recorded)

    def compile_cache(self) -> Path | None:
        """The folder of the compile caches the bundle holds (``None``: it holds none),
        inside :attr:`folder` whatever the manifest says."""
        compiled = self.manifest["compiled"]
        if not compiled:
            return None
        cache = (self.folder / compiled["folder"]).resolve()
        if not cache.is_relative_to(self.folder.resolve()):  # guards the manifest's check
            said = f"its compiled folder {shown(compiled['folder'])} lands outside"
            raise BundleError(f"the bundle is unsafe: {said} {self.folder}", code=E_UNSAFE)
        return cache


def unpack(
    name: str, into: Path, open_location: Callable[[str], Any], *, bound: int | None = None
) -> Unpacked:
    """Fetch the bundle ``name`` (through ``open_location`` for a bucket), verify every
    member and unpack it into the empty folder ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    local = name
    if "://" in name and not name.startswith("file://"):
        local = str(into.parent / f"{into.name}{SUFFIX}")
        # no zip of members within the bound is larger than them and their headers
        fetch(name, local, open_location, limit=(bound or DEFAULT_BOUND) + MAX_MANIFEST + 2**30)
    elif name.startswith("file://"):
        local = name[len("file://") :]
    if not os.path.isfile(local):
        raise BundleError(f"{name}: no such bundle", code=E_FETCH)
    kwargs = {} if bound is None else {"bound": bound}
    try:
        manifest = extract(local, into, **kwargs)
    except BundleError as exc:
        if local == name:
            raise
        # a fetched bundle is named as the user named it, not by its temporary copy
        raise BundleError(exc.message.replace(local, name), code=exc.code) from None
    return Unpacked(manifest, into)


def fetch(
    uri: str, target: str, open_location: Callable[[str], Any], *, limit: int | None = None
) -> None:
    """Copy the object ``uri`` to ``target`` in ranged reads, never whole in memory nor
    past its size; an object over ``limit`` bytes is refused before any is read."""
    from sexpgpu.errors import SexpError

    parent, _, key = uri.rstrip("/").rpartition("/")
    try:
        storage = open_location(parent)
        size = storage.identity(key).size
        if limit is not None and size > limit:
            said = f"{uri} is {size} bytes, more than a bundle within the bound holds"
            raise BundleError(f"the bundle is too large: {said}", code=E_TOO_LARGE)
        with open(target, "wb") as handle:
            for start in range(0, size, _CHUNK):
                wanted = min(_CHUNK, size - start)
                chunk = storage.read_range(key, start, wanted)
                if len(chunk) != wanted:  # a store that says otherwise than it did
                    raise BundleError(f"cannot read the bundle {uri}: it changed", code=E_FETCH)
                handle.write(chunk)
    except BundleError:
        raise
    except SexpError as exc:
        raise BundleError(f"cannot read the bundle {uri}: {exc.message}", code=E_FETCH) from None
    except OSError as exc:  # the local disk: full, or the folder gone
        said = f"cannot copy the bundle {uri} to {target}: {exc.strerror or exc}"
        raise BundleError(said, code=E_FETCH) from None


def installed_versions(plugins: Mapping[str, str]) -> dict[str, Any]:
    """This machine's versions as a manifest's ``versions`` holds them: sexpgpu's, the
    libraries the plugins' distributions require (torch, numpy, ...), and ``plugins``
    (name to version)."""
    from sexpgpu import __version__

    return {"sexpgpu": __version__, "libraries": _libraries(), "plugins": dict(plugins)}


def _libraries() -> dict[str, str]:
    """The installed version of each library sexpgpu requires (not its extras')."""
    import re

    found = {}
    for requirement in metadata.requires(PROJECT) or []:
        if "extra ==" in requirement:
            continue
        name = re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0]
        try:
            found[name.lower()] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return dict(sorted(found.items()))


def version_differences(
    recorded: Mapping[str, Any], here: Mapping[str, Any], *, compared: Iterable[str] = ()
) -> list[str]:
    """``what bundled -> here`` for each version that differs: sexpgpu's, each plugin's
    (``missing`` when this machine lacks it), and each library ``compared``: those
    whose version the bundle's choices record (:func:`pinned_libraries`), since the
    lowering says the bits depend on them. Other libraries are shown, not compared."""
    said = []
    if recorded.get("sexpgpu") != here.get("sexpgpu"):
        said.append(f"sexpgpu {recorded.get('sexpgpu')} -> {here.get('sexpgpu')}")
    libraries, chosen = here.get("libraries", {}), set(compared)
    for name, version in sorted(recorded.get("libraries", {}).items()):
        if name in chosen and libraries.get(name) != version:
            said.append(f"{name} {version} -> {libraries.get(name, 'missing')}")
    plugins = here.get("plugins", {})
    for name, version in sorted(recorded.get("plugins", {}).items()):
        if plugins.get(name) != version:
            said.append(f"plugin {name} {version} -> {plugins.get(name, 'missing')}")
    return said


def pinned_libraries(choices: Mapping[str, str]) -> list[str]:
    """The libraries whose version a run's choices record (``<library>.version``)."""
    return sorted(k[: -len(".version")] for k in choices if k.endswith(".version"))


def refuse_versions(name: str, differences: list[str]) -> BundleError:
    """The one-line refusal of a bundle whose versions differ from this machine's."""
    return BundleError(
        f"{name} was made with other versions than this machine has: "
        + "; ".join(differences)
        + " (install those, or run it with --choices fresh)",
        code=E_VERSIONS,
    )


def machine_kind(choices: Mapping[str, str]) -> dict[str, str]:
    """The part of a run's choices that says what machine made it: the CPU's
    capability and BLAS, or the GPU's name and compute capability."""
    return {
        k: v
        for k, v in choices.items()
        if k in ("cpu.capability", "cpu.blas") or k.startswith("cuda.device")
    }


def machine_differences(bundled: Mapping[str, str], made: Mapping[str, str]) -> list[str]:
    """``choice bundled -> here`` for each machine-kind choice (:func:`machine_kind`) the
    bundle recorded that this machine's lowering made otherwise."""
    here = machine_kind(made)
    return [
        f"{name} {value} -> {here.get(name, 'none')}"
        for name, value in sorted(bundled.items())
        if here.get(name) != value
    ]


def lower_on_its_machine(bundled: Mapping[str, str], lowering: Callable[[], Any]) -> Any:
    """``lowering()`` (a :class:`~sexpgpu.session.Lowered`) for a run that takes the
    bundle's choices ``bundled`` (``{}``: none); ``E-BUNDLE-008`` when one that names the
    bundling machine's kind (:func:`machine_kind`) cannot be taken here, or when this
    machine's lowering records another; ``E-BUNDLE-004`` when another of the bundle's
    choices cannot be taken (a thread count no machine has)."""
    from sexpgpu.choices import ChoiceRefused

    machine = machine_kind(bundled)
    try:
        lowered = lowering()
    except ChoiceRefused as exc:
        if exc.choice in machine:
            raise refuse_machine([f"{exc.choice} {exc.value}: {exc.why}"]) from None
        if bundled.get(exc.choice) == exc.value:  # the bundle's own, which no machine takes
            raise BundleError(
                f"the bundle's choice {exc.choice} {shown(exc.value)} cannot be taken: "
                f"{exc.why} (make the bundle again, or run it with --choices fresh)",
                code=E_MANIFEST,
            ) from None
        raise
    differences = machine_differences(machine, lowered.made) if machine else []
    if differences:
        raise refuse_machine(differences)
    return lowered


def refuse_machine(differences: list[str]) -> BundleError:
    """The one-line refusal of a bundle made on another kind of machine than this one."""
    return BundleError(
        "the bundle was made on another kind of machine: "
        + "; ".join(differences)
        + " (run it on a machine of its kind, or with --choices fresh)",
        code=E_MACHINE,
    )


def check_data(name: str, manifest: Mapping[str, Any]) -> None:
    """Refuse a run whose recorded (not copied) local data files are missing, are not
    regular files, or are not the bytes the bundle recorded (size, then sha256). A
    device or a FIFO is refused without being read or waited on."""
    for entry in manifest["data_files"]:
        if entry["member"] is not None:
            continue
        path = entry["uri"]
        size, digest = _identify_data(name, path, entry["size"])
        if size != entry["size"] or digest != entry["sha256"]:
            raise BundleError(
                f"{name} reads the data file {shown(path)}, which is not the file it was "
                f"made with: {entry['size']} bytes, sha256 {entry['sha256'][:12]} -> {size} "
                f"bytes" + ("" if digest is None else f", {digest[:12]}"),
                code=E_DATA,
            )


def _identify_data(name: str, path: str, size: int) -> tuple[int, str | None]:
    """The size of the regular file ``path`` and, when it is ``size`` bytes, their
    sha256 (read no further than one byte past ``size``)."""

    def unreadable(why: str) -> BundleError:
        return BundleError(
            f"{name} reads the data file {shown(path)}, which cannot be read here: "
            f"{why} (bundle it with --with-data)",
            code=E_DATA,
        )

    try:
        # told before it is opened: opening a device may do something of its own
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise unreadable("it is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in never blocks
    except OSError as exc:
        raise unreadable(exc.strerror or type(exc).__name__) from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise unreadable("it is not a regular file")
        if info.st_size != size:
            return info.st_size, None
        digest, got = hashlib.sha256(), 0
        try:
            while got <= size and (chunk := handle.read(min(_CHUNK, size + 1 - got))):
                digest.update(chunk)
                got += len(chunk)
        except OSError as exc:
            raise unreadable(exc.strerror or type(exc).__name__) from None
    return got, digest.hexdigest() if got == size else None


def open_to_run(name: str, catalog: Catalog, *, fresh: bool) -> Unpacked:
    """The bundle ``name`` unpacked into a scratch folder of this process (removed when
    it exits; after a kill, by the next bundle command) and checked
    (:func:`unpack_to_run`)."""
    import atexit
    import shutil

    from sexpgpu_bundle.scratch import new_scratch_folder

    folder = new_scratch_folder()
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return unpack_to_run(name, folder / "unpacked", catalog, fresh=fresh)


def unpack_to_run(name: str, into: Path, catalog: Catalog, *, fresh: bool) -> Unpacked:
    """The bundle ``name`` unpacked into ``into`` and checked before anything of it is
    compiled: every member, its versions against this machine's (unless ``fresh``), its
    recorded data files, and where its compile caches lie. Every refusal is one
    :class:`BundleError`."""
    unpacked = unpack(name, into, catalog.open_location)
    here = installed_versions(
        {r.name: r.version for r in catalog.records if r.available and not r.disabled}
    )
    compared = pinned_libraries(unpacked.choices)
    differences = version_differences(unpacked.manifest["versions"], here, compared=compared)
    if differences and not fresh:
        raise refuse_versions(name, differences)
    check_data(name, unpacked.manifest)
    unpacked.compile_cache()  # one outside the folder is refused now, before compiling
    return unpacked


# ---------------------------------------------------------------- the source opener


@dataclass
class BundleSource(OpenedSource):
    """A bundle opened to run (:class:`sexpgpu.extension.OpenedSource`): its main file and
    folder, its selection, choices and closed world; a run that takes its choices is
    lowered on the bundling machine's kind (:func:`lower_on_its_machine`)."""

    called: str = "the bundle's"
    manifest: Mapping[str, Any] = field(default_factory=dict)

    def lowered(self, lower: Callable[[], Any], *, fresh: bool) -> Any:
        return lower() if fresh else lower_on_its_machine(dict(self.choices or {}), lower)


class BundleOpener:
    """The :class:`sexpgpu.extension.SourceOpener` of ``.sxb`` files."""

    def open(self, name: str, catalog: Catalog, *, fresh: bool) -> BundleSource:
        unpacked = open_to_run(name, catalog, fresh=fresh)
        cache = unpacked.compile_cache()
        return BundleSource(
            named=name,
            file=unpacked.main,
            root=str(unpacked.folder),
            sets=unpacked.sets,
            variant=unpacked.variant,
            steps=unpacked.steps,
            choices=unpacked.choices,
            files=unpacked.closed_world(name),
            compile_cache=None if cache is None else str(cache),
            manifest=unpacked.manifest,
        )

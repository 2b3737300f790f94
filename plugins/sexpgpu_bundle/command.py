"""``sexpgpu bundle``: one file that replays a run on another machine (docs/bundle.md)."""

from __future__ import annotations

import datetime
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from sexpgpu.catalog import Catalog
from sexpgpu.opening import parse_sets


def catalog() -> Catalog:
    """The catalog the CLI hands its commands."""
    return click.get_current_context().find_object(Catalog)


@click.command("bundle")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", metavar="NAME.sxb", help="The bundle to write.")
@click.option(
    "--show", "shown", metavar="NAME.sxb", help="Print a bundle's manifest; write nothing."
)
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="Set a knob (repeatable).")
@click.option("--steps", type=click.IntRange(min=1), help="Set the knob `steps`.")
@click.option("--variant", help="Take a variant's knob values.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--lowering", metavar="NAME", help="The lowering by name (torch, compiled).")
@click.option(
    "--choose", "requests", multiple=True, metavar="SITE=KERNEL", help="As `sexpgpu run`'s."
)
@click.option(
    "--with-data",
    is_flag=True,
    help="Copy the program's local data files in; otherwise each is recorded by path, "
    "size and sha256 and checked when the bundle runs.",
)
def bundle(
    file: str | None,
    output: str | None,
    shown: str | None,
    sets: tuple[str, ...],
    steps: int | None,
    variant: str | None,
    device: str,
    lowering: str | None,
    requests: tuple[str, ...],
    with_data: bool,
) -> None:
    """Write FILE, its includes, :load files, selection, choices and versions into one
    file, -o NAME.sxb, that `sexpgpu run NAME.sxb` replays."""
    from sexpgpu.errors import UsageError

    if shown is not None:
        if file is not None or output is not None:
            raise UsageError("--show takes a bundle and nothing else")
        _show(shown)
        return
    if file is None or output is None:
        raise UsageError("sexpgpu bundle FILE.sx -o NAME.sxb (or --show NAME.sxb)")
    if not output.endswith(".sxb"):
        raise UsageError(f"a bundle's name ends with .sxb, got '{output}'")
    _check_writable(output)  # before compiling, which may take minutes
    manifest = _make(
        file,
        output,
        sets=parse_sets(sets),
        steps=steps,
        variant=variant,
        device=device,
        lowering=lowering,
        requests=requests,
        with_data=with_data,
    )
    size = sum(m["size"] for m in manifest["members"].values())
    click.echo(f"wrote {output}: {len(manifest['members'])} files, {size} bytes")


def _make(
    file: str, output: str, *, sets: dict[str, str], steps: int | None, variant: str | None,
    device: str, lowering: str | None, requests: tuple[str, ...], with_data: bool,
) -> dict[str, Any]:  # fmt: skip
    from sexpgpu.opening import Selection, Target, parse_requests, prepare_environment
    from sexpgpu_bundle.scratch import new_scratch_folder

    plugins = catalog()
    target = Target(device=device, lowering=lowering or None, choose=parse_requests(requests))
    # one folder for the compile caches and fetched files: removed at the end, or by
    # the next bundle command once this process is gone (a kill)
    scratch = new_scratch_folder()
    try:
        cache = _compile_into_a_new_cache(plugins, target, scratch / "compiled")
        fetched = scratch / "fetched"
        fetched.mkdir()
        selection = Selection(file, sets=sets, variant=variant, steps=steps)
        prepare_environment(plugins, selection, target, resume=None, checkpoint_dir=None)
        return _write(
            plugins, selection, target, output, cache=cache, fetched=fetched, with_data=with_data
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_writable(output: str) -> None:
    """Refuse (``E-BUNDLE-010``) an output whose folder is not there or cannot be
    written, or that is a folder: the write itself says so too, but only after
    compiling."""
    from sexpgpu_bundle.archive import E_UNWRITABLE, BundleError

    folder = os.path.dirname(os.path.abspath(output))
    why = None
    if not os.path.isdir(folder):
        why = f"{folder} is not a folder"
    elif os.path.isdir(output):
        why = "it is a folder"
    elif not os.access(folder, os.W_OK | os.X_OK):  # access(2) says EROFS too
        why = f"{folder} cannot be written"
    if why is not None:
        raise BundleError(f"cannot write {output}: {why}", code=E_UNWRITABLE)


def _write(
    plugins: Any, selection: Any, target: Any, output: str, *, cache: Path | None,
    fetched: Path, with_data: bool,
) -> dict[str, Any]:  # fmt: skip
    """Compile and lower ``selection`` as `run` would, and write the bundle ``output``;
    ``cache``: the empty folder the compiler fills, ``fetched``: one for object-store
    files fetched to be copied in."""
    from sexpgpu.checkpoint import jsonable
    from sexpgpu.session import Session
    from sexpgpu_bundle.archive import write_bundle
    from sexpgpu_bundle.make import gather
    from sexpgpu_bundle.opening import fetch, installed_versions, machine_kind

    session = Session.start(plugins, selection, target)
    trainer = session.lower(target.device)
    seconds = trainer.warm_up()  # a compiling lowering compiles every graph now
    program = session.program
    loads = {p.load.uri for p in program.params if p.load is not None}
    loads |= {source.uri for source in session.loads.sources.values()}

    def fetch_copy(uri: str) -> Path:
        copy = fetched / hashlib.sha256(uri.encode()).hexdigest()  # one name per object
        fetch(uri, str(copy), plugins.open_location)
        return copy

    contents = gather(
        program, loads=loads, data=_data_paths(program, plugins), with_data=with_data,
        fetch=fetch_copy, known=_hashed(session.loaded),
    )  # fmt: skip
    manifest = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "main": contents.main,
        "sources": contents.sources,
        "loads": contents.loads,
        "data_files": contents.data,
        "selection": {
            "variant": program.variant,
            "sets": dict(selection.sets),
            "steps": selection.steps,
            "knobs": [
                {"name": k.name, "value": jsonable(k.value), "source": k.source}
                for k in program.knobs
            ],
        },
        "choices": dict(sorted(session.made.items())),
        "versions": installed_versions(_plugins_used(plugins, program, session.made)),
        "machine": machine_kind(session.made),
        "compiled": None,
    }
    members = dict(contents.members)
    if cache is not None and seconds is not None:
        files = _cache_files(cache)
        members.update(files)
        size = sum(path.stat().st_size for path in files.values())
        manifest["compiled"] = {
            "folder": COMPILED, "files": len(files), "size": size, "seconds": seconds
        }  # fmt: skip
    entries = [*contents.loads, *contents.data]
    read = {e["member"]: (e["size"], e["sha256"]) for e in entries if e.get("member")}
    return write_bundle(output, manifest, members, known=read)


def _hashed(loaded: dict[str, dict[str, Any]]) -> dict[str, tuple[int, str]]:
    """The size and sha256 of each local ``:load`` file the run has already hashed, by
    its real path (a local file's version is ``sha256:<hex>``)."""
    hashed = {}
    for identity in loaded.values():
        uri, version = str(identity["uri"]), str(identity.get("version") or "")
        if "://" not in uri and version.startswith("sha256:"):
            hashed[os.path.realpath(uri)] = (int(identity["size"]), version[len("sha256:") :])
    return hashed


COMPILED = "compiled"
"""The member folder of the lowering's compile caches."""


def _compile_into_a_new_cache(plugins: Any, target: Any, folder: Path) -> Path | None:
    """For a lowering that compiles: ``folder``, made empty, for its compiler to keep
    its caches in (set in the environment before the compiler starts), so that the
    bundle holds all of this program's compiled kernels, and nothing else of this
    machine's caches."""
    from sexpgpu.opening import lowering_for

    info = lowering_for(plugins, target)
    if info is None or info.compile_cache is None:
        return None
    folder.mkdir()
    os.environ.update(info.compile_cache(str(folder)))
    return folder


def _cache_files(folder: Path) -> dict[str, Path]:
    """The files of a compile cache folder as bundle members (its lock files left out)."""
    return {
        f"{COMPILED}/{path.relative_to(folder).as_posix()}": path
        for path in sorted(folder.rglob("*"))
        if path.is_file()
        and not path.is_symlink()
        and "locks" not in path.relative_to(folder).parts
    }


def _plugins_used(plugins: Any, program: Any, made: dict[str, str]) -> dict[str, str]:
    """Each plugin the program uses, by name, with its version: the lowering's and the
    chosen kernels', its optimizers', data sources', plugin ops', eval metrics' and
    the evaluator's.
    A machine that lacks a plugin the program does not use may still run the bundle."""
    ops = set()

    def walk(graph: Any) -> None:
        for node in graph.nodes:
            ops.add(node.op)
            if "body" in node.attrs:
                walk(node.attrs["body"])

    for graph in [stage.loss for stage in program.stages] + [p.graph for p in program.evals]:
        walk(graph)
    kernels = {(site.kind, made.get(site.name)) for site in program.sites}
    wanted = {
        "sexpgpu_lowerings": lambda i: i.name == made.get("lowering"),
        "sexpgpu_kernels": lambda i: (i.kind, i.name) in kernels,
        "sexpgpu_optimizers": lambda i: i.name in {s.optimizer.name for s in program.stages},
        "sexpgpu_data_sources": lambda i: (
            i.name
            in {s.data.source for s in program.stages} | {p.data.source for p in program.evals}
        ),
        "sexpgpu_ops": lambda i: i.name in ops,
        "sexpgpu_eval_metrics": lambda i: any(i.name in p.metrics for p in program.evals),
        "sexpgpu_evaluators": lambda i: bool(program.evals),
    }
    used = {}
    for hook, uses in wanted.items():
        for info, record in plugins.supplied(hook):
            if record.available and not record.disabled and uses(info):
                used[record.name] = record.version
    return dict(sorted(used.items()))


def _data_paths(program: Any, plugins: Any) -> list[str]:
    """The files the program's data sources read (their ``path_options``)."""
    decls = [stage.data for stage in program.stages] + [p.data for p in program.evals]
    paths = []
    for decl in decls:
        info = plugins.data_source(decl.source)
        for option in info.path_options:
            value = decl.options.get(option)
            if isinstance(value, str) and value:
                paths.append(value)
    return paths


def _show(name: str) -> None:
    """Print the manifest of the bundle ``name``, each line escaped as `sexpgpu
    checkpoint` escapes what it prints: a forged path cannot forge a line."""
    from sexpgpu_bundle.archive import describe, read_manifest

    if "://" in name and not name.startswith("file://"):
        from sexpgpu_bundle.opening import fetch
        from sexpgpu_bundle.scratch import new_scratch_folder

        folder = new_scratch_folder()
        try:
            local = str(folder / "bundle.sxb")
            fetch(name, local, catalog().open_location)
            manifest = read_manifest(local)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        manifest = read_manifest(name.removeprefix("file://"))
    for line in describe(manifest):
        escaped = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in line)
        click.echo(escaped)  # a forged path cannot forge a line
    sys.stdout.flush()

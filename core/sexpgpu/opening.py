"""Opening a request: what ``sexpgpu run`` (or ``sexpgpu.train.run``) was asked turned
into what a run needs before anything imports torch (docs/architecture.md).

A `.sx` file is compiled as it is; another file is opened by the plugin whose source
opener takes the end of its name (a bundle, ``.sxb``), and the
:class:`~sexpgpu.extension.OpenedSource` it gives carries it, inside the
:class:`Selection`, to the checkpoint. :func:`prepare_environment` sets what the run's
lowering says its pinned choices need (libraries that read their settings once, when
they start) and the compile caches a source brings. Torch-free.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sexpgpu.choices import LOWERING_CHOICE, Choices, kernel_requests
from sexpgpu.errors import PluginError, SexpError, UsageError

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.extension import LoweringInfo, OpenedSource
    from sexpgpu.lang.ir import Program


@dataclass(frozen=True)
class Selection:
    """What to compile: a `.sx` file, its knobs (``--set``), its variant and ``--steps``;
    ``source``: the source it was opened from, when it is not the file named."""

    file: str
    sets: Mapping[str, str] = field(default_factory=dict)
    variant: str | None = None
    steps: int | None = None
    source: OpenedSource | None = None

    @classmethod
    def recorded(cls, experiment: Mapping[str, Any], file: str | None = None) -> Selection:
        """The selection a checkpoint's run was compiled under: its file (or ``file``),
        its variant, and the knobs its command line set."""
        from sexpgpu.checkpoint.records import command_line_knobs

        sets, steps = command_line_knobs(experiment)
        variant = experiment.get("variant")
        return cls(
            file or experiment["file"],
            sets=sets,
            variant=None if variant in (None, "-") else variant,
            steps=steps,
        )

    @property
    def root(self) -> str | None:
        """The folder whose files a checkpoint names by their paths in it (a source's)."""
        return None if self.source is None else self.source.root

    def opened(self, catalog: Catalog, *, fresh: bool = False) -> Selection:
        """This selection with its file opened when a source opener takes it (a bundle,
        ``fresh``: for a run that chooses afresh), its knobs, variant and steps under
        these; else itself."""
        info = None if self.source is not None else catalog.source_opener(self.file)
        if info is None:
            return self
        try:
            source = info.factory().open(self.file, catalog, fresh=fresh)
        except SexpError:
            raise
        except Exception as exc:  # a plugin's mistake is told as its, never a traceback
            raise PluginError(
                f"the source opener '{info.name}' failed on {self.file}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        return Selection(
            source.file,
            sets={**source.sets, **self.sets},
            variant=self.variant or source.variant,
            steps=self.steps or source.steps,
            source=source,
        )

    def compile(self, catalog: Catalog, *, check_files: bool = True) -> Program:
        """The checked program (``check_files``: see :func:`sexpgpu.lang.compile_file`)."""
        from sexpgpu.lang import compile_file

        return compile_file(
            self.file,
            catalog=catalog,
            sets=dict(self.sets),
            variant=self.variant,
            steps=self.steps,
            check_files=check_files,
            files=None if self.source is None else self.source.files,
        )


@dataclass(frozen=True)
class Target:
    """How to lower: the device, the lowering (``--lowering``), the kernels asked for
    (``--choose``: ``{site or kind: kernel}``), other choices by name (``{"cpu.threads":
    "2"}``), the front end's option naming each (``--threads``), and whether a resume
    chooses again (``--choices fresh``)."""

    device: str = "cpu"
    lowering: str | None = None
    choose: Mapping[str, str] = field(default_factory=dict)
    requests: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)
    fresh: bool = False

    def choices(self, program: Program | None, recorded: Mapping[str, str] | None) -> Choices:
        """The run's :class:`Choices` against a checkpoint's ``recorded`` ones (``None``
        on a fresh start); ``program`` resolves ``--choose`` targets to its sites."""
        requested = dict(self.requests)
        asked = {name: self._words(name, value) for name, value in self.requests.items()}
        if self.lowering:
            requested[LOWERING_CHOICE] = self.lowering
            asked[LOWERING_CHOICE] = f"--lowering {self.lowering}"
        if self.choose and program is not None:
            kernels, words = kernel_requests(program, self.choose, self.options)
            requested.update(kernels)
            asked.update(words)
        return Choices.make(requested=requested, asked=asked, recorded=recorded, fresh=self.fresh)

    def _words(self, name: str, value: str) -> str:
        option = self.options.get(name)
        return f"{option} {value}" if option else f"{name}={value}"


def _pairs(values: Iterable[str], option: str, form: str, *, strip: bool) -> dict[str, str]:
    """``NAME=VALUE`` items by name, the last one of a name winning; ``strip``: values
    are words, stripped and never empty (a knob's text goes to the compiler as it is)."""
    pairs: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or (strip and not value.strip()):
            raise UsageError(f"{option} takes {form}, got '{item}'")
        pairs[name.strip()] = value.strip() if strip else value
    return pairs


def parse_sets(values: Iterable[str]) -> dict[str, str]:
    """``("lr=0.25", "steps=6")`` -> ``{"lr": "0.25", "steps": "6"}``; the compiler types them."""
    return _pairs(values, "--set", "name=value", strip=False)


def parse_requests(values: Iterable[str]) -> dict[str, str]:
    """``("attention=sdpa", "stack:model.blocks=looped")`` -> ``{target: kernel}``, as
    ``--choose`` takes them (a :class:`UsageError` for an item that is not one)."""
    return _pairs(values, "--choose", "SITE=KERNEL or KIND=KERNEL", strip=True)


def recorded_choices(experiment: Mapping[str, Any], catalog: Catalog) -> dict[str, str]:
    """A checkpoint's recorded ``choices``, with the lowering it ran on when it is older
    than that record (the lowering that says so: ``LoweringInfo.unrecorded``)."""
    recorded = {str(k): str(v) for k, v in experiment.get("choices", {}).items()}
    if LOWERING_CHOICE not in recorded:
        ran_on = next((info.name for info in catalog.lowerings() if info.unrecorded), None)
        if ran_on is not None:
            recorded[LOWERING_CHOICE] = ran_on
    return recorded


def open_request(
    catalog: Catalog,
    selection: Selection,
    target: Target,
    *,
    resume: str | None,
    checkpoint_dir: str | None,
) -> Selection:
    """``selection`` opened (:meth:`Selection.opened`), with the environment its lowering
    needs set when a source opener took it: ``sexpgpu.train.run`` runs a bundle as the
    command does."""
    opened = selection.opened(catalog, fresh=target.fresh)
    if opened is not selection:
        prepare_environment(catalog, opened, target, resume=resume, checkpoint_dir=checkpoint_dir)
    return opened


def prepare_environment(
    catalog: Catalog,
    selection: Selection,
    target: Target,
    *,
    resume: str | None,
    checkpoint_dir: str | None,
) -> dict[str, str]:
    """Set, in ``os.environ``, what the lowering's libraries must start with to take this
    run's pinned choices (a resume's record, else its source's, and the user's
    requests), and the compile caches its source brings; returns it."""
    recorded = checkpoint_choices(catalog, resume, checkpoint_dir) if resume else None
    source = selection.source
    if recorded is None and source is not None and source.choices is not None:
        recorded = dict(source.choices)
    try:
        info = lowering_for(catalog, target, recorded)
        env = {} if info is None or info.environment is None else dict(
            info.environment(target.choices(None, recorded).pins())
        )  # fmt: skip
        cache = None if source is None or target.fresh else source.compile_cache
        if cache is not None and info is not None and info.compile_cache is not None:
            env.update(info.compile_cache(cache))  # its kernels, read instead of chosen again
    except SexpError:
        return {}
    overridden = {k: v for k, v in env.items() if k in os.environ and os.environ[k] != v}
    os.environ.update(env)
    if overridden and recorded is not None and not target.fresh:
        from sexpgpu.log import get_logger

        # This machine's own setting was set aside: say so, the run did move.
        get_logger("sexpgpu.run").info(
            "environment pinned to the checkpoint's choices", **overridden
        )
    return env


def checkpoint_choices(
    catalog: Catalog, resume: str, checkpoint_dir: str | None
) -> dict[str, str] | None:
    """The ``choices`` of the checkpoint ``--resume`` names; ``None`` for none, or one that
    cannot be read (the run's own read says so in its place). A location that cannot be
    reached is refused here: its retries (seconds, on a dead endpoint) are not made twice."""
    from sexpgpu import checkpoint as ckpt
    from sexpgpu.errors import StorageError

    try:
        found = ckpt.resolve_resume(resume, checkpoint_dir, catalog.open_location)
    except StorageError as error:
        if os.environ.get("WORLD_SIZE") and os.environ.get("RANK", "0") != "0":
            sys.exit(error.exit_code)  # every rank meets it: rank 0 says it, as for the run's
        raise
    except (SexpError, OSError):
        return None
    if found is None:
        return None
    try:
        experiment = ckpt.read_experiment(*found)
    except (SexpError, OSError):
        return None
    return recorded_choices(experiment, catalog)


def lowering_for(
    catalog: Catalog, target: Target, recorded: Mapping[str, str] | None = None
) -> LoweringInfo | None:
    """The lowering a run of ``target`` takes (``--lowering``, a pinned record, else the
    device kind's default), known before anything imports its libraries."""
    from sexpgpu.kernels import choose_lowering, device_kind
    from sexpgpu.plugin_supplies import defaults_of

    lowerings = catalog.lowerings()
    info = choose_lowering(lowerings, device=target.device, choices=target.choices(None, recorded))
    if info is None:
        kind = device_kind(target.device)
        info = next((i for i in lowerings if kind in defaults_of(i)), None)
    return info

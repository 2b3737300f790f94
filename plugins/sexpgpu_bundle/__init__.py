"""The bundle plugin: ``NAME.sxb``, one file that replays a run on another machine
(docs/bundle.md, DESIGN.md "Bundles").

It supplies a source opener for files ending ``.sxb`` (``sexpgpu run NAME.sxb``, and
``sexpgpu.train.run`` given one), which fetches, checks and unpacks a bundle before
anything of it is compiled, and the ``sexpgpu bundle`` command, which writes one.
Written as a third party would write it, on the core's public API alone:
:mod:`~sexpgpu_bundle.archive` is the on-disk format (a zip holding ``manifest.json``
and its members), :mod:`~sexpgpu_bundle.opening` opens one to run,
:mod:`~sexpgpu_bundle.closed` holds its program to the files it brings,
:mod:`~sexpgpu_bundle.make` gathers what a bundle holds, :mod:`~sexpgpu_bundle.scratch`
keeps its temporary folders, and :mod:`~sexpgpu_bundle.command` is the command.
Importing this module stays cheap: the rest is imported when it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sexpgpu.extension import SourceOpener, SourceOpenerInfo
from sexpgpu.hookspecs import hookimpl

if TYPE_CHECKING:
    import click

SUFFIX = ".sxb"


def _opener() -> SourceOpener:
    from sexpgpu_bundle.opening import BundleOpener

    return BundleOpener()


@hookimpl
def sexpgpu_source_openers() -> list[SourceOpenerInfo]:
    """Bundles: a file whose name ends ``.sxb``."""
    return [
        SourceOpenerInfo(
            name="bundle",
            suffix=SUFFIX,
            factory=_opener,
            doc="a bundle: sources, :load files, data, choices and compiled kernels in one file",
        )
    ]


@hookimpl
def sexpgpu_cli_commands(cli: click.Group) -> None:
    """``sexpgpu bundle``."""
    from sexpgpu_bundle.command import bundle

    cli.add_command(bundle)

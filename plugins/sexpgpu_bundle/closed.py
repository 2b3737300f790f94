"""A bundle is a closed world: what its program names, it holds or recorded.

A bundle's run compiles the sources it unpacked, which anyone may have written; every
file they name (an ``include``, a ``:load`` or ``:with-loaded`` file, a data source's
file) must be one of the bundle's own, in the folder it was unpacked into, or a local
data file the bundle recorded with its sha256 (checked before the run, see
:func:`sexpgpu_bundle.opening.check_data`). Data in an object store stays a URI, as
``sexpgpu bundle`` leaves it. Anything else is refused while the program compiles,
before it is read, naming the path (``E-BUNDLE-009``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn
from urllib.parse import unquote, urlparse

from sexpgpu_bundle.archive import BundleError, shown

E_OUTSIDE = "E-BUNDLE-009"
"""A bundle whose program names a file it neither holds nor recorded."""

_SAID = {"include": "includes", "load": "loads", "data": "reads the data file"}


@dataclass(frozen=True)
class ClosedWorld:
    """The files a bundle's program may name: those under ``folder`` (the real path of
    the folder it was unpacked into), and the ``recorded`` data files (real paths).
    Called as a :data:`~sexpgpu.lang.syntax.FileCheck`."""

    bundle: str
    """The bundle as the user named it, for the refusal's line."""
    folder: str
    recorded: frozenset[str] = frozenset()

    @classmethod
    def of(cls, bundle: str, folder: str, recorded: Iterable[str]) -> ClosedWorld:
        """The closed world of ``bundle``, unpacked into ``folder``, which recorded the
        local data files ``recorded`` (paths as its manifest names them)."""
        return cls(bundle, os.path.realpath(folder), frozenset(map(os.path.realpath, recorded)))

    def __call__(self, what: str, location: str) -> None:
        """Take ``location`` (``what``: ``include``, ``load`` or ``data``) or refuse it."""
        path = location
        if "://" in location:
            try:
                parsed = urlparse(location)
            except ValueError:  # a malformed host: no store opens it either
                self._refuse(what, location, "which is no location")
            if parsed.scheme.lower() != "file":
                if what != "data":  # object-store data is a URI a bundle never copies
                    self._refuse(what, location, "which is not in the bundle")
                return
            if parsed.netloc not in ("", "localhost"):
                self._refuse(what, location, "a file of another machine")
            path = unquote(parsed.path)
        if "\x00" in path:
            self._refuse(what, location, "which no file system holds")
        real = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
        if os.path.commonpath([real, self.folder]) == self.folder:
            return
        if what == "data" and real in self.recorded:
            return
        self._refuse(what, location, "which the bundle neither holds nor recorded")

    def _refuse(self, what: str, location: str, why: str) -> NoReturn:
        raise BundleError(
            f"{self.bundle} {_SAID.get(what, 'names')} {shown(location)}, {why}: a bundle reads only "
            "its own files and the local data files it recorded (make it again with "
            "`sexpgpu bundle`)",
            code=E_OUTSIDE,
        )

"""Small builders of .sx programs for the language tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sexpgpu import lang
from sexpgpu.catalog import Catalog
from sexpgpu.lang.ir import Program, TensorType
from tests.profiles import suite_env

HERE = Path(__file__).parent
FAKE = HERE / "fakeplugin"
ROOT = HERE.parent.parent
EXAMPLES = ROOT / "examples"


def _fake_plugin():
    sys.path.insert(0, str(FAKE))
    try:
        import sexpgpu_lang_fake
    finally:
        sys.path.remove(str(FAKE))
    return sexpgpu_lang_fake


def _catalog() -> Catalog:
    import sexpgpu_eval
    import sexpgpu_gcs
    import sexpgpu_local
    import sexpgpu_s3

    return Catalog.of(
        {
            "lang-fake": _fake_plugin(),
            "eval": sexpgpu_eval,
            "local": sexpgpu_local,
            "s3": sexpgpu_s3,
            "gcs": sexpgpu_gcs,
        }
    )


CATALOG = _catalog()
"""What the language tests compile against: the fake plugin's data sources and
optimizers, and the project's own eval passes and storage schemes."""


def compile_text(text: str, name: str = "main.sx", **kw) -> Program:
    """:func:`sexpgpu.lang.compile_text` against :data:`CATALOG`."""
    return lang.compile_text(text, name, catalog=CATALOG, **kw)


def compile_file(path: str, **kw) -> Program:
    """:func:`sexpgpu.lang.compile_file` against :data:`CATALOG`."""
    return lang.compile_file(path, catalog=CATALOG, **kw)


def cli_env() -> dict[str, str]:
    """The environment for running `sexpgpu` in a subprocess: the project's own
    plugins only (the fake would conflict with the real data sources and optimizers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEXPGPU_")}
    return suite_env(env)


def program(body: str, *, run: str = "", name: str = "t.sx", **kw) -> Program:
    """A program from ``body`` (models, data...) and a ``defrun`` with ``run``'s options
    added to a minimal one."""
    text = f"{body}\n(defrun t {run})\n"
    return compile_text(text, name, **kw)


def model_output(
    params: str, forward: str, *, args: str = "(x)", data: str = "(vectors)"
) -> TensorType:
    """The type a model with ``params`` and forward body ``forward`` gives on ``data``'s inputs."""
    text = f"""
(defmodel m ()
  {params}
  (forward {args} {forward}))
(defdata d {data} :seq 6 :batch 4)
(defrun t :model (m) :data d :loss (sum (cast (model inputs) f32)) :optimizer (sgd :lr 0.1) :steps 1)
"""
    loss = compile_text(text, "t.sx").stages[0].loss
    cast = loss.nodes[loss.nodes[loss.outputs[0]].args[0]]
    return loss.nodes[cast.args[0]].type


BASE = """
(defknob lr 0.5 "learning rate")
(defknob steps 4)
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (tokens) (matmul (take embed tokens) head)))
(defdata train (arithmetic :digits 3) :seq 8 :batch 2)
"""

RUN = """:model (net 16 8) :data train :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr lr) :steps steps"""


def sexpgpu(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    """``sexpgpu args...`` run as a user runs it, in ``cwd``."""
    exe = str(Path(sys.executable).with_name("sexpgpu"))
    return subprocess.run(
        [exe, *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout
    )


def in_process(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``sexpgpu args...`` for a command that trains nothing (``check``, ``compile``), in
    this process with :func:`sexpgpu`'s environment: tests/inprocess.py."""
    from tests import inprocess

    return inprocess.sexpgpu(*args, cwd=cwd, env=cli_env())

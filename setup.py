"""Build of the compiled data plane: the Cython extensions under ``exchange/``.

Everything else is in pyproject.toml. Each ``.pyx`` is one extension (a rebuild after one
change stays short); there is no pure-Python fallback, so a missing C compiler is an
install error that says what to install.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, ExecError, PlatformError

HERE = Path(__file__).resolve().parent
PYX = sorted(p.relative_to(HERE) for p in (HERE / "exchange").rglob("*.pyx"))

NO_COMPILER = (
    "pyspark-exchange compiles its data plane (Cython) at install and needs a C compiler "
    "and the Python headers ({include}). On Debian/Ubuntu: apt-get install build-essential "
    "(scripts/ensure-compiler.sh does it when run as root), then install again."
)


class BuildExt(build_ext):
    """``build_ext`` that names the missing compiler instead of failing obscurely."""

    def run(self) -> None:
        include = sysconfig.get_paths()["include"]
        if not (Path(include) / "Python.h").exists():
            raise SystemExit("error: no Python.h. " + NO_COMPILER.format(include=include))
        try:
            super().run()
        except (CompileError, ExecError, PlatformError) as exc:  # e.g. no gcc on PATH
            raise SystemExit(f"error: {exc}. " + NO_COMPILER.format(include=include)) from exc


extensions = [
    Extension(".".join(p.with_suffix("").parts), [str(p)], extra_compile_args=["-O2"]) for p in PYX
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3, "embedsignature": True},
    ),
    cmdclass={"build_ext": BuildExt},
)

"""setuptools' hooks for the native build at install time (the metadata is in pyproject.toml).

Building a wheel (``pip install`` of the sdist, ``pip wheel``, ``python -m build``) runs
``llama_metaws/native/package.py``'s ``stage_wheel`` after setuptools copied the Python
package: the patched llama.cpp and the cffi shim are built (cached by the build key, ``CMAKE_ARGS``
passed through) and copied into the wheel with the build's sources. An editable install (``pip
install -e .``, the Makefile's) builds nothing here: ``llama-metaws build`` does. The module is
loaded from this tree without importing the package, whose ``__init__`` needs the binding.
"""

import functools
import importlib.util
import sys
import types
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _package_module():
    """``llama_metaws.native.package`` (with its ``build``, ``manifest`` and ``llama_metaws.paths``)
    from this tree, under a private package name: the real package's ``__init__`` is never run."""
    name = "_llama_metaws_setup"
    for sub, folder in ((name, HERE / "llama_metaws"), (f"{name}.native", HERE / "llama_metaws" / "native")):
        if sub not in sys.modules:
            pkg = types.ModuleType(sub)
            pkg.__path__ = [str(folder)]
            sys.modules[sub] = pkg
    spec = importlib.util.find_spec(f"{name}.native.package")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class build_py_with_native(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            package = _package_module()
            try:
                package.stage_wheel(Path(self.build_lib))
            except package._build.BuildError as e:
                sys.exit(f"llama-metaws: the native build failed: {e}")


class NativeDistribution(Distribution):
    """A platform wheel when it carries the native build (the shim is a CPython extension)."""

    def has_ext_modules(self):
        return _package_module().build_at_install()


setup(cmdclass={"build_py": build_py_with_native}, distclass=NativeDistribution)

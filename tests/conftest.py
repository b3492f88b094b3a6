import os

import pytest

import llama_metaws  # noqa: F401  (points llama_cpp at the patched build; import it first)
from llama_metaws.native.runtime import require_build
from suite_env import suite_environment

# no build for the current inputs: say so before anything imports llama_cpp
_BUILD = require_build()

# the suite's own environment, before any test or process it starts (tests/suite_env.py)
_ENV = suite_environment(os.environ, _BUILD)
for _name in [k for k in os.environ if k not in _ENV]:
    del os.environ[_name]
os.environ.update(_ENV)


@pytest.fixture(scope="session", autouse=True)
def _cost_curves(tmp_path_factory):
    """draft_max="auto" saves its measured cost curves (engine.prior): in a folder of the session's,
    never the user's cache (the servers the tests start inherit it)."""
    from llama_metaws.engine.prior import COSTS_ENV

    old = os.environ.get(COSTS_ENV)
    os.environ[COSTS_ENV] = str(tmp_path_factory.mktemp("costs"))
    yield
    if old is None:
        os.environ.pop(COSTS_ENV, None)
    else:
        os.environ[COSTS_ENV] = old


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_mtp_model(models_dir):
    from llama_metaws_dev.testing import make_tiny_mtp_model

    return make_tiny_mtp_model(models_dir / "tiny-mtp.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_model(models_dir):
    from llama_metaws_dev.testing import make_tiny_model

    return make_tiny_model(models_dir / "tiny-llama.gguf", seed=0)

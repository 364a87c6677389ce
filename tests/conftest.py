"""Shared fixtures: the real default GGUF, the benchmark prompts, an untrained draft for it."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

from hetero_spec.default_model import shipped_model_path
from hetero_spec.target.gguf_weights import cache_dir

warnings.filterwarnings("ignore", message=".*quantiz.*", category=UserWarning)


def _private_cache() -> None:
    """Every cache the tests write (dequantized weights, int8 checks, calibrations: keyed by file path,
    so one set per run for the temporary GGUFs and drafts, about 150 MB) goes to a folder removed at
    exit; the default models are shared with the user's cache (building them takes a while).  Set in
    the environment so that the CLI's subprocesses use it too."""
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="hetero-spec-test-cache-"))
    (root / "models").symlink_to(models, target_is_directory=True)
    os.environ["HETERO_SPEC_CACHE"] = str(root)
    atexit.register(shutil.rmtree, root, True)


_private_cache()


@pytest.fixture(scope="session")
def model_path() -> Path:
    return shipped_model_path()  # raises with the install command when the package is missing


@pytest.fixture(scope="session")
def random_draft_path(model_path, tmp_path_factory) -> Path:
    from hetero_spec.draft_factory import create_draft

    out = tmp_path_factory.mktemp("drafts") / "untrained.safetensors"
    return create_draft(model_path, out, preset="darter", reduced_vocab=8192, seed=1)


@pytest.fixture(scope="session")
def hs(model_path, random_draft_path):
    from hetero_spec.api import HeteroSpec

    with HeteroSpec(model_path, random_draft_path, n_ctx=2048, draft_device="cpu") as h:
        yield h

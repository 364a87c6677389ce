"""The command a measurement script records in its result file, so that the docs can quote it.

WHY from ``sys.argv`` where it can be: the arguments as typed reproduce the run, where a line rebuilt from
the parsed options names only the options its author thought of.  The default model's path is
machine-specific (a cache folder), so it is written as the docs write it, and only when it is the model
given: the scripts that rebuild their line wrote the default model whatever model they were given.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Sequence

from ..default_model import DEFAULT_FILENAME

DEFAULT_MODEL_ARG = '"$(python scripts/default_model.py)"'  # how the docs name the default target


def is_default_model(arg: str) -> bool:
    """``arg`` is the default target's requantization in this machine's cache (``default_model_path``'s file:
    ``<cache>/models/<size of the shipped file>-SmolLM2-135M-Instruct.Q4_0.gguf``)."""
    from ..target.gguf_weights import cache_dir

    p = Path(arg)
    size, _, name = p.name.partition("-")
    return name == DEFAULT_FILENAME and size.isdigit() and p.parent.resolve() == (cache_dir() / "models").resolve()


def model_arg(path: str | Path) -> str:
    """A model path as a recorded command names it: the default target as the docs do, any other shell-quoted."""
    return DEFAULT_MODEL_ARG if is_default_model(str(path)) else shlex.quote(str(path))


def script_command(argv: Sequence[str]) -> str:
    """``argv`` (a script's ``sys.argv``) as the command that reproduces its run: ``python scripts/NAME.py`` and
    the arguments shell-quoted, the default model as ``"$(python scripts/default_model.py)"``."""
    return " ".join([f"python scripts/{Path(argv[0]).name}", *map(model_arg, argv[1:])])

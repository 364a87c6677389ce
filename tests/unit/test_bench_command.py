"""The command a measurement script records (``hetero_spec/bench/command.py``): the docs quote it, so it must
reproduce the run and name the default model as the docs do, and no other model as the default."""
from __future__ import annotations

import shlex

from hetero_spec.bench.command import DEFAULT_MODEL_ARG, model_arg, script_command
from hetero_spec.default_model import DEFAULT_FILENAME


def test_the_default_model_is_named_as_the_docs_name_it_and_any_other_as_given(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path / "cache"))
    default = tmp_path / "cache" / "models" / f"77571136-{DEFAULT_FILENAME}"
    assert model_arg(default) == DEFAULT_MODEL_ARG
    # the same file name outside the cache, another model in it, and a name that only ends alike are not the default
    for other in (tmp_path / DEFAULT_FILENAME, tmp_path / "elsewhere" / f"77571136-{DEFAULT_FILENAME}",
                  tmp_path / "cache" / "models" / "77571136-gemma-3-270m.Q5_0.gguf",
                  tmp_path / "cache" / "models" / f"new-{DEFAULT_FILENAME}"):
        assert model_arg(other) == shlex.quote(str(other))


def test_a_script_records_its_arguments_as_typed_and_quoted_for_the_shell(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path))
    default = str(tmp_path / "models" / f"1-{DEFAULT_FILENAME}")
    argv = ["/somewhere/scripts/bench_corpus.py", default, "--system", "You are a tutor.", "--prompts", "8",
            "--json", "results/x.json"]
    command = script_command(argv)
    assert command == (f"python scripts/bench_corpus.py {DEFAULT_MODEL_ARG} --system 'You are a tutor.' --prompts 8 "
                       "--json results/x.json")
    # what a shell makes of it is the arguments again, the model as the script that prints its path
    assert shlex.split(command)[2:] == ["$(python scripts/default_model.py)", *argv[2:]]

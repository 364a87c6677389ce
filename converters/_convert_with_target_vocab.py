"""Run llama.cpp's convert_hf_to_gguf.py with the vocabulary copied from the target GGUF.

Executed as a script in a subprocess (``converters/llama_convert.py``), never imported by hetero-spec:

    python _convert_with_target_vocab.py LLAMA_CPP_DIR TARGET.gguf -- CONVERTER ARGS...

Why the one override: an EAGLE-3 draft has no tokenizer of its own; the converter takes it from the
target's HF directory (``--target-model-dir``) and recognises the BPE pre-tokenizer by hashing a test
string's token ids against a table of known models.  A GGUF target has no HF tokenizer files, and
rebuilding ``tokenizer.json`` from the GGUF loses the pre-tokenizer (transformers' GGUF loader drops
SmolLM's digit splitting, for one), so the hash would not match.  The draft's vocabulary *is* the
target's, and llama.cpp checks exactly that before drafting (token texts, BOS/EOS), so its
``tokenizer.*`` keys are copied verbatim from the target GGUF.  Everything else -- EAGLE-3 detection,
tensor names, the Q/K RoPE permutation, d2t as absolute ids -- is the vendored converter's own code.
"""
from __future__ import annotations

import sys
from pathlib import Path


def copy_tokenizer_keys(writer, target_gguf: str) -> int:
    """Copy every ``tokenizer.*`` key of ``target_gguf`` into ``writer``; returns how many."""
    import gguf

    reader = gguf.GGUFReader(target_gguf, "r")
    n = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:  # raw bytes: a token need not be valid UTF-8
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, value, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[field.data[0]]), vtype)
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
        n += 1
    return n


def main() -> None:
    llama_cpp_dir, target_gguf, sep, *args = sys.argv[1:]
    if sep != "--":
        raise SystemExit("usage: _convert_with_target_vocab.py LLAMA_CPP_DIR TARGET.gguf -- CONVERTER ARGS...")
    sys.path.insert(0, llama_cpp_dir)
    script = Path(llama_cpp_dir) / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *args]
    import convert_hf_to_gguf  # noqa: E402  (puts the vendored gguf-py first on sys.path)
    from conversion.llama import LlamaModel  # noqa: E402

    def set_vocab(self) -> None:
        copy_tokenizer_keys(self.gguf_writer, target_gguf)

    LlamaModel.set_vocab = set_vocab
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()

"""Tiny random-weight GGUFs of every common decoder family, built offline the way users' files are made.

WHY: a user's own model (Llama 3, Qwen 2.5/3, Mistral, Phi-3, Gemma 2/3, ...) reaches hetero-spec as
a GGUF written by llama.cpp's ``convert_hf_to_gguf.py`` and quantized by ``llama-quantize``.  Each
family has its own llama.cpp graph (QK norms, biases, fused QKV, sliding windows, soft-capping,
tied heads, experts), and exactness (speculative greedy output == plain decoding) has to hold on
every one.  Real weights of these families are not on PyPI, so the architecture matrix uses
random-weight models with the real structure, small enough to build in seconds and decode in
milliseconds:

1. a transformers config of the family (4 layers, enough for EAGLE-3's 3 taps, hidden 256, GQA where the family has it),
   random weights (seeded), ``save_pretrained``;
2. a byte-level BPE tokenizer trained with ``tokenizers`` on the shipped bench prompts (512 ids,
   ChatML special tokens and chat template, so ``export-features`` and ``chat`` work);
3. the *vendored* ``convert_hf_to_gguf.py`` of the pinned llama-cpp-python sdist (the same
   converter users run for this llama.cpp commit), to an F32 GGUF;
4. ``llama_model_quantize`` (``hetero_spec.target.quantize``) to Q4_0, Q8_0 and Q4_K_M.

Hidden size 256 (not 64) so that Q4_K_M really holds Q4_K rows: k-quants need rows that are a
multiple of 256 and llama.cpp silently falls back to Q5_0/Q8_0 for narrower ones, which would
hide the repacked-Q4_K batch dependence the matrix has to document.

Two things of the converter are steered, both for tokenizer reasons only (the graph and the
weights go through it untouched): it recognises a BPE pre-tokenizer by hashing a real model's
tokenization of a test string, which a tokenizer trained here can never match, so the family's
pre-tokenizer name is given; and Gemma 2's converter reads only SentencePiece models (the
``sentencepiece`` package is not a dependency), so without ``tokenizer.model`` it takes the BPE
path that Gemma 3's converter already has.

Models are cached under ``<cache>/models/tiny/`` keyed by builder version and llama.cpp version,
so CI builds them once (about a minute for all on 2 cores).
"""
from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import atomic_file
from .errors import HeteroSpecError

BUILDER_VERSION = 2  # bump when a config, the tokenizer or the conversion changes: the cache key
QUANTS = ("Q4_0", "Q8_0", "Q4_K_M")
VOCAB = 512
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: BOS, turn start, EOS/end of turn
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# shapes shared by every family: small, but wide enough for k-quants (see the module docstring)
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 4, 2, 64


class TinyModelError(HeteroSpecError):
    pass


@dataclass(frozen=True)
class TinyFamily:
    """One decoder family: the transformers config that makes it and what llama.cpp calls it."""

    name: str  # cache and test id
    arch: str  # general.architecture llama.cpp reads from the converted file
    config_class: str  # transformers config class
    model_class: str  # transformers *ForCausalLM class (its name is config.json's architecture)
    pre: str  # tokenizer.ggml.pre written for the trained BPE (llama.cpp's regex for this family)
    users_run: str  # the real models of this family people run (for the docs' matrix)
    config: dict = field(default_factory=dict)  # family-specific config fields over the shared shapes


FAMILIES: dict[str, TinyFamily] = {f.name: f for f in (
    TinyFamily("llama", "llama", "LlamaConfig", "LlamaForCausalLM", "llama-bpe", "Llama 3.x, SmolLM2",
               {"head_dim": HEAD_DIM}),
    TinyFamily("mistral", "llama", "MistralConfig", "MistralForCausalLM", "llama-bpe", "Mistral 7B",
               {"head_dim": HEAD_DIM, "sliding_window": None}),
    TinyFamily("qwen2", "qwen2", "Qwen2Config", "Qwen2ForCausalLM", "qwen2", "Qwen 2.5 (QKV biases, tied head)",
               {"tie_word_embeddings": True}),
    TinyFamily("qwen3", "qwen3", "Qwen3Config", "Qwen3ForCausalLM", "qwen2", "Qwen 3 dense (QK norms)",
               {"head_dim": HEAD_DIM, "tie_word_embeddings": True}),
    TinyFamily("qwen3moe", "qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen2", "Qwen 3 MoE (30B-A3B)",
               {"head_dim": HEAD_DIM, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                "decoder_sparse_step": 1, "mlp_only_layers": []}),
    TinyFamily("phi3", "phi3", "Phi3Config", "Phi3ForCausalLM", "gpt-2", "Phi-3 / Phi-3.5 mini (fused QKV, gate-up)",
               {"num_key_value_heads": HEADS, "pad_token_id": 0, "original_max_position_embeddings": 1024}),
    TinyFamily("gemma2", "gemma2", "Gemma2Config", "Gemma2ForCausalLM", "gpt-2", "Gemma 2 (soft-capping, SWA)",
               {"head_dim": HEAD_DIM, "sliding_window": 16, "query_pre_attn_scalar": HEAD_DIM,
                "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2), "pad_token_id": 0}),
    TinyFamily("gemma3", "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", "gpt-2", "Gemma 3 (QK norms, SWA)",
               {"head_dim": HEAD_DIM, "sliding_window": 16, "query_pre_attn_scalar": HEAD_DIM,
                "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2), "pad_token_id": 0}),
)}


# ------------------------------------------------------------------------------- where things live
def tiny_models_dir() -> Path:
    from .target._ffi import PINNED_VERSION
    from .target.gguf_weights import cache_dir

    return cache_dir() / "models" / "tiny" / f"v{BUILDER_VERSION}-llama.cpp-{PINNED_VERSION}"


def tiny_model_path(family: str, quant: str) -> Path:
    """The cached GGUF of ``family`` at ``quant``, built (with the family's other quants) on first use."""
    fam = _family(family)
    quant = _quant(quant)
    out = tiny_models_dir() / f"{fam.name}-{quant}.gguf"
    if not out.is_file():
        build_family(fam.name, (quant,))
    return out


def llama_cpp_source() -> Path:
    """The llama.cpp tree vendored in the pinned llama-cpp-python sdist (``converters.llama_convert``: the
    tree ``scripts/build_llama_cpp.sh`` unpacked, else fetched once with pip), under a lock so that
    concurrent builders fetch it once."""
    from converters.llama_convert import _cache_root, find_converter

    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".fetch.lock"):
        try:
            return find_converter()
        except Exception as err:  # ConvertError: one line for the user, as the converter's own
            raise TinyModelError(str(err)) from None


def build_family(family: str, quants: tuple[str, ...] = QUANTS, *, force: bool = False) -> dict[str, Path]:
    """Build ``family``'s F32 GGUF (kept, as the quantizations' source) and ``quants``; returns quant -> path.

    Under a lock file, so concurrent test processes build once; every file is renamed into place whole."""
    from .target.quantize import QuantizeOptions, quantize

    fam = _family(family)
    quants = tuple(_quant(q) for q in quants)
    folder = tiny_models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    out = {q: folder / f"{fam.name}-{q}.gguf" for q in quants}
    with _locked(folder / f".{fam.name}.lock"):
        f32 = folder / f"{fam.name}-F32.gguf"
        if force or not f32.is_file():
            with tempfile.TemporaryDirectory(prefix=f"tiny-{fam.name}-") as tmp:
                hf = Path(tmp) / "hf"
                write_hf_model(fam, hf)
                with atomic_file.replacing(f32) as tmp_gguf:
                    convert(hf, tmp_gguf, fam)
        for q, path in out.items():
            if force or not path.is_file():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    quantize(f32, path, QuantizeOptions(type=q, threads=2))
    return out


def build_all(families: tuple[str, ...] | None = None, quants: tuple[str, ...] = QUANTS, *, force: bool = False,
              progress: bool = True) -> dict[str, dict[str, Path]]:
    """Every family (or ``families``) at every quant in ``quants``, with a progress bar."""
    from tqdm import tqdm

    names = tuple(families or FAMILIES)
    built: dict[str, dict[str, Path]] = {}
    for name in tqdm(names, desc="tiny models", unit="family", disable=not progress, file=sys.stderr):
        built[name] = build_family(name, quants, force=force)
    return built


def write_hf_model(fam: TinyFamily, out: Path, *, seed: int = 0) -> Path:
    """A transformers checkpoint of ``fam`` with random weights (seeded) and the trained tokenizer."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                  bos_token_id=0, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.08)
    fields.update(fam.config)
    config = getattr(transformers, fam.config_class)(**fields)
    config.architectures = [fam.model_class]
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model_class)(config).to(torch.float32)
    with torch.no_grad():  # norms at 1 (Gemma's are stored as w - 1): transformers inits some at 0 or 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)  # random, so that each family's norm convention (w vs 1 + w) matters
    model.save_pretrained(out, safe_serialization=True)
    return out


def write_tokenizer(out: Path) -> None:
    """Byte-level BPE (``VOCAB`` ids, ChatML specials) trained on the shipped bench prompts: offline,
    deterministic, and read by the converter's GPT-2 BPE path (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .bench.prompts import DATASETS, bench_prompts

    texts = [p for name in DATASETS for p in bench_prompts(name, 10_000) if isinstance(p, str)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise TinyModelError(f"the trained tokenizer has {tok.get_vocab_size()} ids, not {VOCAB}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        # GPT2Tokenizer: the name Phi-3's converter needs to take the BPE path (it is a fast tokenizer here)
        "tokenizer_class": "GPT2Tokenizer", "bos_token": SPECIALS[0], "eos_token": SPECIALS[2],
        "pad_token": SPECIALS[0], "add_bos_token": False, "add_prefix_space": False, "chat_template": CHATML,
        "model_max_length": 1024,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0]}))


# The converter run in a child process (it puts its own gguf-py first on sys.path, which must not meet the
# gguf this process imported).  The two steered points are explained in the module docstring.
_CONVERT_DRIVER = r"""
import sys
from pathlib import Path
src, pre = sys.argv[1], sys.argv[2]
sys.argv = [str(Path(src) / "convert_hf_to_gguf.py"), *sys.argv[3:]]
sys.path.insert(0, src)
sys.path.insert(1, str(Path(src) / "gguf-py"))
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
_spm = TextModel._set_vocab_sentencepiece
def _set_vocab_sentencepiece(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        return self._set_vocab_gpt2()
    return _spm(self, *a, **k)
TextModel._set_vocab_sentencepiece = _set_vocab_sentencepiece
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert(hf_dir: Path, out: Path, fam: TinyFamily) -> Path:
    """``convert_hf_to_gguf.py HF_DIR --outfile OUT --outtype f32`` from the vendored llama.cpp."""
    src = llama_cpp_source()
    r = subprocess.run([sys.executable, "-c", _CONVERT_DRIVER, str(src), fam.pre, str(hf_dir), "--outfile", str(out),
                        "--outtype", "f32"], capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        raise TinyModelError(f"convert_hf_to_gguf.py failed on the tiny {fam.name} model:\n"
                             f"{(r.stderr or r.stdout)[-2000:]}")
    return out


# ---------------------------------------------------------------------------------------- helpers
def _family(name: str) -> TinyFamily:
    if name not in FAMILIES:
        raise TinyModelError(f"unknown family {name!r}; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def _quant(name: str) -> str:
    key = name.upper().replace("-", "_")
    if key not in QUANTS:
        raise TinyModelError(f"unknown quantization {name!r}; the matrix builds {', '.join(QUANTS)}")
    return key


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clean(folder: Path | None = None) -> None:
    """Remove every built tiny model (the next use rebuilds)."""
    shutil.rmtree(folder or tiny_models_dir(), ignore_errors=True)

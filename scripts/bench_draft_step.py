"""The draft step as the runtime runs it: the shipped draft, the target's real rows, interleaved settings.

    python scripts/bench_draft_step.py MODEL.gguf [DRAFT.safetensors] [--setting NAME ...] [--rounds 300] [--positions 1200]
    python scripts/bench_draft_step.py MODEL.gguf --device cuda      # the CUDA settings (scripts/gpu_proof.sh)

Loads the draft against the target exactly as ``hetero-spec run`` does (``api.load_runner``: the
cached int8 check, context rows), prefills it with the target's rows of a held-out text (the first
prompts of the four shipped sets, never the int8 calibration text), then times chains of ``-k``
proposals from real rows, the settings taking turns round by round so that a drifting machine
moves them all alike.  Each turn runs a ``k+1``-row target decode (the verification the runtime runs
between two drafts, which evicts the draft's weights from the caches), times the chain right after
it (what the runtime pays), then the same chain again at once (back to back, caches warm).  Prints per setting the median ms per draft step (a chain's time / k) both ways, and
how often its proposals equal the float32 draft's, teacher-forced from every position of the text
(``equal k=1``: the first proposal; ``equal chain``: every step of a k-chain whose earlier steps
were equal).  ``--json FILE`` writes the same figures.

Settings (``--setting``, repeatable; default: all of them):
  float32         float32 weights, 1 thread, the general forward
  (every int8 setting picks a chain step's proposal through the int8 head's ``best``: its top rows
  rescored in float, no full logits)
  int8-1t-slow    the int8 runtime before issue 43: fbgemm int8 blocks and head, float32 fusion, the
                  general forward (``_blocks``), 1 thread
  int8-1t-onerow  the same with the one-position forward (``DraftRunner._forward_one``)
  int8-1t         int8 everywhere (weight-only int8 fusion and taps' fc), the one-position forward, 1 thread
  int8-2t         the same on 2 threads (the target's are idle while the draft runs)
  native-1t       the runtime's CPU int8 path (issue 43): the whole greedy chain as one native call
                  (draft/native.py: int8 weights, int8 activations outside the fusion's first layer and
                  the taps' fc, the host's integer dot-product kernel), 1 thread
  native-2t       the same on the target's 2 threads: what ``run`` runs
With ``--device cuda`` (equal to a float32 draft on CUDA):
  cuda-bf16       bf16, each chain step one CUDA graph replay, pinned non-blocking hand-off (the runtime)
  cuda-bf16-eager the same without the graph
  cuda-float32    float32 with the graph
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import click
import numpy as np
import torch


@dataclass(frozen=True)
class Setting:
    dtype: str  # --draft-dtype
    threads: int  # torch threads while the draft runs
    one_row: bool  # the one-position forward (DraftRunner._forward_one)
    float_fusion: bool = False  # the fusion and tap_fc in float32 (the runtime before issue 43)
    device: str = "cpu"
    graph: bool = True  # CUDA: replay the one-position step as a graph
    native: bool = False  # the greedy chain as one native call (draft/native.py; the runtime's CPU int8 path)


SETTINGS = {
    "float32": Setting("float32", 1, False),
    "int8-1t-slow": Setting("auto", 1, False, float_fusion=True),
    "int8-1t-onerow": Setting("auto", 1, True, float_fusion=True),
    "int8-1t": Setting("auto", 1, True),
    "int8-2t": Setting("auto", 2, True),
    "native-1t": Setting("auto", 1, True, native=True),
    "native-2t": Setting("auto", 2, True, native=True),
}
CUDA_SETTINGS = {
    "cuda-float32": Setting("float32", 0, True, device="cuda"),
    "cuda-bf16": Setting("auto", 0, True, device="cuda"),
    "cuda-bf16-eager": Setting("auto", 0, True, device="cuda", graph=False),
}
REFERENCE = {"cpu": "float32", "cuda": "cuda-float32"}


def set_threads(s: Setting) -> None:
    if s.threads:
        torch.set_num_threads(s.threads)


def held_out_ids(target, n: int) -> list[int]:
    from hetero_spec.bench.prompts import DATASETS, load_dataset

    text = "\n\n".join(p for name in DATASETS for p in load_dataset(name, 6).prompts)
    return target.tokenize(text)[:n]


def make_runner(target, draft: str, s: Setting):
    from hetero_spec import int8_cache
    from hetero_spec.api import load_runner
    from hetero_spec.config import DenoiseConfig
    from hetero_spec.draft import int8

    saved = int8.weight_int8_available
    if s.float_fusion:  # the fusion stays float32, as it did before weight-only int8
        int8.weight_int8_available = lambda: False
    try:
        r = load_runner(target, draft, device=s.device, dtype=s.dtype, denoise=DenoiseConfig())
    finally:
        int8.weight_int8_available = saved
    r._one_row = s.one_row
    if not s.native:
        r._native = None
    elif r._native is None:
        raise click.ClickException("the native draft step did not build here (a C++ compiler with OpenMP is needed)")
    else:
        r._native.threads = s.threads
    r.cuda_graph = r.cuda_graph and s.graph
    assert int8_cache  # the check is read from (or written to) the same cache as the runtime's
    return r


def proposals(r, hidden: np.ndarray, ids: list[int], start: int, k: int) -> np.ndarray:
    """[n, k] chains proposed from every real position after ``start``, each from the cached prefix."""
    r.reset()
    r.prefill(hidden[:start], ids[1 : start + 1])
    r.add_context(ids)
    out = []
    for j in range(start, len(ids) - 1):
        n = r.n
        out.append(r.propose(hidden[j : j + 1], ids[j + 1 : j + 2], k))
        r.rollback(n)
    r.reset()
    return np.array(out)


def chain_equal(a: np.ndarray, ref: np.ndarray) -> float:
    """Share of chain steps equal to the reference among those whose earlier steps were equal."""
    ok = a == ref
    live = np.cumprod(np.concatenate([np.ones((len(a), 1), bool), ok[:, :-1]], axis=1), axis=1).astype(bool)
    return float(ok[live].mean())


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("draft", default="drafts/smollm2-135m-darter.safetensors", type=click.Path(exists=True, dir_okay=False))
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--setting", "names", multiple=True, type=click.Choice(list(SETTINGS) + list(CUDA_SETTINGS)),
              help="default: all of the device's")
@click.option("-k", "k", default=3, show_default=True, help="proposals per timed chain")
@click.option("--rounds", default=300, show_default=True, help="timed chains per setting and way")
@click.option("--context", default=300, show_default=True, help="cached positions before timing")
@click.option("--positions", default=300, show_default=True,
              help="held-out positions after those: each proposes a chain for the equality check (over 300, one or "
                   "two mismatched chains move it by half a point), and the timed rounds cycle through them")
@click.option("--threads", "target_threads", default=2, show_default=True, help="the target's threads")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def main(model: str, draft: str, device: str, names: tuple[str, ...], k: int, rounds: int, context: int, positions: int,
         target_threads: int, json_out: str | None) -> None:
    from hetero_spec.api import draft_taps
    from hetero_spec.draft import native
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    table = {**SETTINGS, **CUDA_SETTINGS}
    asked = names  # as given on the command line, for the recorded command
    if not names and device == "cpu" and native.load_library() is None:  # asked for by name, it fails clearly instead
        click.echo("the native draft step did not build here (no C++ compiler with OpenMP): its settings are left out",
                   err=True)
        names = tuple(n for n in SETTINGS if not SETTINGS[n].native)
    names = names or tuple(CUDA_SETTINGS if device == "cuda" else SETTINGS)
    with LlamaTarget(model, TargetOptions(n_ctx=4096, n_threads=target_threads, embeddings=True,
                                          taps=draft_taps(draft))) as target:
        ids = held_out_ids(target, context + positions)
        hidden, _ = target.prefill(ids)
        hidden = np.array(hidden, dtype=np.float32)
        target.reset()
        runners = {n: make_runner(target, draft, table[n]) for n in names}
        ref = proposals(make_runner(target, draft, table[REFERENCE[device]]), hidden, ids, context, k)
        equal = {}
        for n, r in runners.items():
            set_threads(table[n])
            got = proposals(r, hidden, ids, context, k)
            equal[n] = (float((got[:, 0] == ref[:, 0]).mean()), chain_equal(got, ref))
        for r in runners.values():
            r.prefill(hidden[:context], ids[1 : context + 1])
            r.add_context(ids)
        target.prefill(ids[:context])
        times: dict[str, dict[str, list[float]]] = {n: {"back": [], "after": []} for n in names}
        span = len(ids) - 1 - context
        for i in range(rounds + 20):
            j = context + i % span
            for n, r in runners.items():
                target.verify(ids[j : j + k + 1])  # k+1 rows, as a chain's verification
                target.rollback(context)
                set_threads(table[n])
                for way in ("after", "back"):  # right after the decode, then the same chain again at once
                    pos = r.n
                    t0 = time.perf_counter()
                    r.propose(hidden[j : j + 1], ids[j + 1 : j + 2], k)
                    dt = time.perf_counter() - t0
                    r.rollback(pos)
                    if i >= 20:  # warm-up rounds not counted
                        times[n][way].append(dt / k)
        torch.set_num_threads(1)
    out = {}
    for n in names:
        r = runners[n]
        back, after = (statistics.median(times[n][w]) * 1e3 for w in ("back", "after"))
        weights = r.weights if r.step_kind == "torch" else f"{r.weights} {r.step_kind}"
        out[n] = dict(weights=weights, device=table[n].device, threads=table[n].threads, ms_per_step=back, ms_per_step_after_target=after,
                      equal_k1=equal[n][0], equal_chain=equal[n][1], positions=span, k=k)
        click.echo(f"{n:13s} {weights:13s} {back:6.3f} ms/step back to back, {after:6.3f} after a target decode; "
                   f"equal to float32: k=1 {equal[n][0]:.1%}, chain {equal[n][1]:.1%} ({span} positions)")
    if json_out:
        from hetero_spec.bench.command import model_arg

        with open(json_out, "w", encoding="utf-8") as fh:
            extra = [f"{flag} {value}" for flag, value, default in (
                ("--device", device, "cpu"), ("--positions", positions, 300), ("--context", context, 300), ("-k", k, 3),
                ("--threads", target_threads, 2)) if value != default]
            extra += [f"--setting {n}" for n in asked]
            command = " ".join([f"python scripts/bench_draft_step.py {model_arg(model)}",
                                f"--rounds {rounds}", *extra, f"--json {json_out}"])
            json.dump({"command": command, "k": k, "context": context, "rounds": rounds, "machine": machine(), "settings": out},
                      fh, indent=1)


def machine() -> str:
    """The CPU (and GPU) the figures come from."""
    from hetero_spec.calibration import machine_id

    gpu = f"; {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return machine_id(0) + gpu


if __name__ == "__main__":
    main()

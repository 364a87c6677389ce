"""What an engine step costs: the batched engine in-process, one slot against N, plain and with drafts.

    python scripts/bench_engine.py "$(python scripts/default_model.py)" --slots 4 --prompts 8 --max-tokens 128
    python scripts/bench_engine.py "$(python scripts/default_model.py)" --draft drafts/smollm2-135m-darter.safetensors

Every mt_bench first turn (chat template applied) is queued at once; the engine runs until all are
answered.  Per configuration: wall time, time inside llama_decode, steps and rows per step, the cost
of a step holding only plain rows (one token per generating slot), and generated tokens/s.  The
last row lets the engine draft (suffix-match copies priced on the batch, ``engine/cost.py``), from the
step prices the server uses (measured the first time for this machine, model and layout, then read).
With ``--draft``, three more: the draft model's chains (up to 4 deep, priced on the batch) with 1 and
with N slots, and N slots drafting 3 every step (unpriced), each with its acceptance and the draft's
measured step time.

``--passes N`` runs every configuration once per pass, the order rotated pass by pass so that a drifting
machine slows them alike, and reports each figure's median over the passes (the JSON keeps every pass too).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

from hetero_spec.bench.command import model_arg
from hetero_spec.bench.prompts import shipped_text
from hetero_spec.chat_template import render_chat
from hetero_spec.engine import Drafting, Engine, Request
from hetero_spec.target.sequences import SequenceOptions


def run(model: Path, n_seq: int, depth: int, texts: list[str], max_tokens: int, threads: int,
        draft: Path | None = None, draft_depth: int = 0, priced: bool = True) -> dict:
    from hetero_spec.engine.drafts import open_slots

    t, drafts = open_slots(model, draft, SequenceOptions(n_seq=n_seq, seq_ctx=1024, n_threads=threads), device="cpu")
    with t:
        engine = Engine(t, max_waiting=len(texts), draft=drafts,
                        drafting=Drafting(lookup_depth=depth, draft_depth=draft_depth, priced=priced))
        if depth or draft_depth:  # the server's prices for this layout: measured once, then read (price_cache.py)
            engine.calibrate(cached=True)
        submitted: list[Request] = []
        for text in texts:
            chat = render_chat(t.chat_template, [{"role": "user", "content": text}], bos_token=t.bos_token,
                               eos_token=t.eos_token)
            submitted.append(Request(t.tokenize(chat, add_special=False), max_tokens))
            engine.submit(submitted[-1])
        t0 = time.perf_counter()
        steps = rows = generated = plain_steps = 0
        decode_s = plain_s = 0.0
        for rec, _ in engine.run():
            if rec is None:
                continue
            steps += 1
            rows += rec.rows
            decode_s += rec.decode_s
            generated += rec.plain_rows + rec.accepted
            if not rec.prompt_rows:
                plain_steps += 1
                plain_s += rec.decode_s
        wall = time.perf_counter() - t0
        draft_rows = sum(r.drafted for r in submitted)
        accepted = sum(r.accepted for r in submitted)
        step_ms = drafts.step_ms if drafts is not None else None
    return {"slots": n_seq, "lookup_depth": depth, "draft_depth": draft_depth, "priced": priced, "wall_s": wall,
            "decode_s": decode_s, "steps": steps, "rows_per_step": rows / steps,
            "plain_step_ms": 1e3 * plain_s / max(plain_steps, 1), "generated_tps": generated / wall,
            "drafted": draft_rows, "accepted": accepted, "draft_step_ms": step_ms}


MEDIAN_KEYS = ("wall_s", "decode_s", "steps", "rows_per_step", "plain_step_ms", "generated_tps", "drafted", "accepted",
               "draft_step_ms")


def _median(values: list):
    """The median of one figure over the passes (None where a configuration has no such figure)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--slots", default=4, show_default=True, type=click.IntRange(2, 32))
@click.option("--prompts", default=8, show_default=True, type=click.IntRange(1))
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--threads", "-t", default=0, show_default=True, help="0: every core")
@click.option("--draft", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a draft file: also run its chains in the slots")
@click.option("--passes", default=1, show_default=True, type=click.IntRange(1),
              help="runs of every configuration, interleaved; figures are medians")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="write the rows here")
def main(model, slots, prompts, max_tokens, threads, draft, passes, json_out):
    turns = [json.loads(ln)["turns"][0] for ln in shipped_text("mt_bench").splitlines() if ln.strip()][:prompts]
    configs = [(1, 0, None, 0, True, "plain rows"), (slots, 0, None, 0, True, "plain rows"),
               (slots, 16, None, 0, True, "copy drafts priced on the batch")]
    if draft is not None:
        configs += [(1, 0, draft, 4, True, "draft model priced"), (slots, 0, draft, 4, True, "draft model priced"),
                    (slots, 0, draft, 3, False, "draft model, 3 every step")]
    runs: list[list[dict]] = [[] for _ in configs]
    for p in range(passes):  # every configuration once a pass, the first one rotating
        for i in [(p + j) % len(configs) for j in range(len(configs))]:
            n_seq, depth, d, k, priced, _ = configs[i]
            runs[i].append(run(model, n_seq, depth, turns, max_tokens, threads, d, k, priced))
    rows = []
    for (n_seq, depth, d, k, priced, label), rs in zip(configs, runs):
        r = {**rs[0], **{key: _median([x[key] for x in rs]) for key in MEDIAN_KEYS}, "label": label}
        if passes > 1:
            r["passes"] = rs
        rows.append(r)
        extra = ""
        if d is not None:
            extra = (f"; {r['drafted']} drafted, {r['accepted']} accepted, draft step "
                     f"{r['draft_step_ms'] or float('nan'):.2f} ms")
        click.echo(f"{r['slots']} slot(s), {label}: {r['generated_tps']:.1f} generated tok/s; wall {r['wall_s']:.2f} s, "
                   f"in llama_decode {r['decode_s']:.2f} s; {r['steps']} steps of {r['rows_per_step']:.1f} rows; a "
                   f"plain-rows step {r['plain_step_ms']:.1f} ms{extra}")
    if json_out:
        command = (f'python scripts/bench_engine.py {model_arg(model)} --slots {slots} --prompts '
                   f'{prompts} --max-tokens {max_tokens}' + (f" -t {threads}" if threads else "")
                   + (f" --draft {draft}" if draft else "") + (f" --passes {passes}" if passes > 1 else "")
                   + f" --json {json_out}")
        json_out.write_text(json.dumps({"command": command, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()

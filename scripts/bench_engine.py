"""What an engine step costs: the batched engine in-process, one slot against N, plain and with copy drafts.

    python scripts/bench_engine.py "$(python scripts/default_model.py)" --slots 4 --prompts 8 --max-tokens 128

Every mt_bench first turn (chat template applied) is queued at once; the engine runs until all are
answered.  Per configuration: wall time, time inside llama_decode, steps and rows per step, the cost
of a step holding only plain rows (one token per generating slot), and generated tokens/s.  The
last row lets the engine draft (suffix-match copies priced on the batch, ``engine/cost.py``), after
its start-up probe of step costs.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from hetero_spec.bench.prompts import shipped_text
from hetero_spec.chat_template import render_chat
from hetero_spec.engine import Drafting, Engine, Request
from hetero_spec.target.sequences import SequenceOptions, SequenceTarget


def run(model: Path, n_seq: int, depth: int, texts: list[str], max_tokens: int, threads: int) -> dict:
    opts = SequenceOptions(n_seq=n_seq, seq_ctx=1024, n_threads=threads)
    with SequenceTarget(model, opts) as t:
        engine = Engine(t, max_waiting=len(texts), drafting=Drafting(lookup_depth=depth))
        if depth:
            engine.calibrate()
        for text in texts:
            chat = render_chat(t.chat_template, [{"role": "user", "content": text}], bos_token=t.bos_token,
                               eos_token=t.eos_token)
            engine.submit(Request(t.tokenize(chat, add_special=False), max_tokens))
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
    return {"slots": n_seq, "draft_depth": depth, "wall_s": wall, "decode_s": decode_s, "steps": steps,
            "rows_per_step": rows / steps, "plain_step_ms": 1e3 * plain_s / max(plain_steps, 1),
            "generated_tps": generated / wall}


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--slots", default=4, show_default=True, type=click.IntRange(2, 32))
@click.option("--prompts", default=8, show_default=True, type=click.IntRange(1))
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--threads", "-t", default=0, show_default=True, help="0: every core")
def main(model, slots, prompts, max_tokens, threads):
    turns = [json.loads(ln)["turns"][0] for ln in shipped_text("mt_bench").splitlines() if ln.strip()][:prompts]
    for n_seq, depth in ((1, 0), (slots, 0), (slots, 16)):
        r = run(model, n_seq, depth, turns, max_tokens, threads)
        click.echo(f"{r['slots']} slot(s), {'copy drafts priced on the batch' if depth else 'plain rows'}: "
                   f"{r['generated_tps']:.1f} generated tok/s; wall {r['wall_s']:.2f} s, in llama_decode "
                   f"{r['decode_s']:.2f} s; {r['steps']} steps of {r['rows_per_step']:.1f} rows; a plain-rows step "
                   f"{r['plain_step_ms']:.1f} ms")


if __name__ == "__main__":
    main()

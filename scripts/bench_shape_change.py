"""What a decode costs right after a decode of another batch shape, against the same shape back to back.

    python scripts/bench_shape_change.py MODEL.gguf [-t 2] [--repeats 12]

``calibrate`` times each row count back to back, where llama.cpp reuses the graph it built for the
previous batch.  Auto's drafted and lookup rounds come between plain one-row rounds, so each of
them, and the plain round after it, meets a batch of a new shape.  This prints the median time of
each row count in patterns such as [1] (back to back) and [1, 2] (alternating), all decoded at the
same positions (rolled back after each decode), with embeddings on and off.

Then the one-row decodes that follow one decode of n rows (or a 30 ms sleep), each by its place after
it, against a settled stream: the after-effect ``calibrate`` charges to the wider round
(``calibration.SETTLE_ROUNDS``).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

from hetero_spec.calibration import SETTLE_ROUNDS
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

PATTERNS = ([1], [2], [1, 2], [2, 2, 2, 1], [5], [1, 5])
AFTER_ROWS = (1, 2, 4, 16, 0)  # 0: a sleep instead of a decode


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--threads", "-t", default=2, show_default=True, type=click.IntRange(1))
@click.option("--repeats", default=12, show_default=True, type=click.IntRange(3))
def main(model: Path, threads: int, repeats: int) -> None:
    target = LlamaTarget(model, TargetOptions(n_threads=threads, embeddings=True))
    try:
        target.prefill(target.tokenize("The history of the Roman empire is long and " * 8))
        base = target.n_past

        def decode_ms(rows: int) -> float:
            t0 = time.perf_counter()
            target.verify([100 + i for i in range(rows)])
            elapsed = time.perf_counter() - t0
            target.rollback(base)
            return 1e3 * elapsed

        for embeddings in (True, False):
            target.set_embeddings(embeddings)
            for pattern in PATTERNS:
                for _ in range(3):  # warm-up: the pattern's graphs and buffers exist before timing
                    for rows in pattern:
                        decode_ms(rows)
                times: dict[int, list[float]] = {rows: [] for rows in pattern}
                for _ in range(repeats):
                    for rows in pattern:
                        times[rows].append(decode_ms(rows))
                medians = ", ".join(f"{rows} rows {statistics.median(v):.2f} ms" for rows, v in times.items())
                click.echo(f"embeddings {'on ' if embeddings else 'off'}  pattern {pattern}: {medians}")
        target.set_embeddings(False)
        for rows in AFTER_ROWS:
            after: list[list[float]] = []
            for _ in range(repeats):
                for _ in range(SETTLE_ROUNDS):  # a settled stream first
                    decode_ms(1)
                if rows:
                    target.set_embeddings(True)
                    decode_ms(rows)
                    target.set_embeddings(False)
                else:
                    time.sleep(0.03)
                after.append([decode_ms(1) for _ in range(SETTLE_ROUNDS + 2)])
            medians = ", ".join(f"{statistics.median(a[i] for a in after):.2f}" for i in range(SETTLE_ROUNDS + 2))
            click.echo(f"one-row decodes after {f'{rows} rows' if rows else '30 ms asleep'}: {medians} ms")
    finally:
        target.close()


if __name__ == "__main__":
    main()

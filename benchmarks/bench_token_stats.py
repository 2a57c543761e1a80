"""Peak extra memory and time of the naive token statistics vs otb_tir.token_stats, on CPU.

    python benchmarks/bench_token_stats.py            # T=4096, V=151,936 float32 (logits 2.5 GB; ~10 GB peak)
    python benchmarks/bench_token_stats.py --small    # T=512, V=32,000: a quick run

Every variant runs in a fresh subprocess (so no allocator cache carries over). The subprocess
builds its inputs, resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``),
runs the variant once and reads ``VmHWM``: peak extra memory = VmHWM − VmRSS before the run. This
sees every byte torch's CPU allocator touches (tracemalloc would not). The time is the median of
``--repeat`` runs in that process. Ratios are against the naive variant of the same task measured
in the same invocation.

Tasks:
- ``sp``: Σπ² from logits. naive = ``softmax(z).square().sum(-1)``; ours = ``sum_pi_squared_from_logits``.
- ``stats``: log-prob, entropy, Σπ² from logits (no grad). naive materializes ``log_softmax`` and
  ``exp`` of it; ours = ``token_stats_from_logits``.
- ``hidden_fwd``: the same from hidden states and the LM head (no grad). naive = ``hidden @ W.T``
  then naive stats; ours = ``token_stats_from_hidden``.
- ``hidden_bwd``: forward + backward of ``log_probs.sum() − 0.01·entropy.sum()`` to hidden and W.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TASKS = ("sp", "stats", "hidden_fwd", "hidden_bwd")


def _status() -> dict[str, int]:
    """VmHWM / VmRSS in bytes: the trainer's one reader of ``/proc/self/status``."""
    from otb_tir.trainer.timing import memory_kb

    return {k: v * 1024 for k, v in memory_kb().items()}


def _naive_stats(z, labels):
    import torch

    logp = torch.log_softmax(z, dim=-1)  # [T, V]
    p = logp.exp()  # [T, V]
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(p * logp).sum(-1)
    sp = p.square().sum(-1)
    return lp, ent, sp


def worker(
    task: str, impl: str, tokens: int, vocab: int, hidden_size: int, repeat: int, chunk: int | None, threads: int | None
) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from otb_tir.token_stats import sum_pi_squared_from_logits, token_stats_from_hidden, token_stats_from_logits

    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,))
    if task in ("sp", "stats"):
        logits = torch.randn(tokens, vocab) * 3
        if task == "sp":
            run = (
                (lambda: torch.softmax(logits, -1).square().sum(-1))
                if impl == "naive"
                else (lambda: sum_pi_squared_from_logits(logits, chunk=chunk))
            )
        else:
            run = (
                (lambda: _naive_stats(logits, labels))
                if impl == "naive"
                else (lambda: token_stats_from_logits(logits, labels, chunk=chunk))
            )
    else:
        hidden = torch.randn(tokens, hidden_size, requires_grad=task == "hidden_bwd")
        weight = (torch.randn(vocab, hidden_size) * hidden_size**-0.5).requires_grad_(task == "hidden_bwd")

        def stats():
            if impl == "naive":
                return _naive_stats(hidden @ weight.T, labels)
            return token_stats_from_hidden(hidden, weight, labels, chunk=chunk)

        if task == "hidden_fwd":

            def run():
                with torch.no_grad():
                    return stats()
        else:

            def run():
                hidden.grad = weight.grad = None
                lp, ent, _ = stats()
                (lp.sum() - 0.01 * ent.sum()).backward()
                return hidden.grad, weight.grad

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status()["VmRSS"]
    t0 = time.perf_counter()
    out = run()
    times = [time.perf_counter() - t0]
    peak = _status()["VmHWM"] - before
    check = [float(t.double().sum()) for t in out]
    grad_bytes = sum(t.numel() * t.element_size() for t in out) if task == "hidden_bwd" else 0
    del out
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {
        "task": task,
        "impl": impl,
        "peak_extra": peak,
        "time": statistics.median(times),
        "check": check,
        "grad_bytes": grad_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="T=512, V=32000, hidden 128, chunk 16: a quick run")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the fused tasks")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--chunk", type=int, default=None, help="tokens per chunk (default: the library's, 110 at V=151,936)"
    )
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's). On a loaded machine multi-threaded small ops stall "
        "at OpenMP barriers; --threads 1 shows the single-core cost",
    )
    ap.add_argument("--worker", nargs=2, metavar=("TASK", "IMPL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small:
        args.tokens, args.vocab, args.hidden = 512, 32_000, 128
        args.chunk = args.chunk or 16  # the same chunk/T fraction as the default at full size
    if args.worker:
        print(
            json.dumps(
                worker(*args.worker, args.tokens, args.vocab, args.hidden, args.repeat, args.chunk, args.threads)
            )
        )
        return

    tv = args.tokens * args.vocab * 4
    print(
        f"T={args.tokens} V={args.vocab} float32; one [T, V] float32 tensor = {tv / 2**20:,.0f} MiB; "
        f"hidden size (fused tasks) = {args.hidden}; chunk = {args.chunk or 'default'}; median of {args.repeat} runs; "
        f"torch threads = {args.threads or 'default'}"
    )
    print(
        f"{'task':<11} {'impl':<6} {'peak extra MiB':>15} {'x [T,V]':>8} {'time s':>8} {'mem ratio':>10} "
        f"{'time ratio':>11}"
    )
    ok = True
    for task in args.tasks.split(","):
        res = {}
        for impl in ("naive", "ours"):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                task,
                impl,
                "--tokens",
                str(args.tokens),
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
                "--repeat",
                str(args.repeat),
            ]
            if args.chunk:
                cmd += ["--chunk", str(args.chunk)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{task}/{impl} failed:\n{proc.stderr}")
            res[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
        n, o = res["naive"], res["ours"]
        for impl, r in (("naive", n), ("ours", o)):
            ratio_m = "" if impl == "naive" else f"{r['peak_extra'] / max(n['peak_extra'], 1):10.3f}"
            ratio_t = "" if impl == "naive" else f"{r['time'] / n['time']:11.2f}"
            print(
                f"{task:<11} {impl:<6} {r['peak_extra'] / 2**20:15,.1f} {r['peak_extra'] / tv:8.3f} "
                f"{r['time']:8.3f} {ratio_m:>10} {ratio_t:>11}"
            )
        agree = all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(n["check"], o["check"]))
        if not agree:
            ok = False
            print(f"  !! {task}: results differ: naive {n['check']} vs ours {o['check']}")
        if task in ("sp", "stats"):
            target = o["peak_extra"] <= 0.10 * n["peak_extra"]
            print(f"  target chunked ≤ 10% of naive extra memory: {'met' if target else 'NOT met'}")
        else:
            # the hidden/weight gradients are outputs every method must allocate; the rest is working memory
            work = o["peak_extra"] - o["grad_bytes"]
            target = work < 0.5 * tv  # one materialized [T, V] would make it ≥ 1
            print(
                f"  fused working memory (peak extra − {o['grad_bytes'] / 2**20:,.1f} MiB of returned gradients) "
                f"= {work / tv:.3f} × [T,V] bytes "
                f"({'never materializes [T, V]' if target else 'NOT below half a [T, V]'})"
            )
        ok = ok and target
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Speculation on real work: plain vs --speculative ngram vs --speculative suffix, one server each,
runs alternated, through ``tokenline bench serve --dataset-path``.

Two prompt sets are built here from in-repo text (nothing is downloaded):

- **code-edit**: a function from tokenline's own sources, "rename X to Y and output the whole
  file", after one worked example, so that the answer copies the file with a few words changed;
- **quotes**: a passage of :data:`tokenline.bench.throughput.PASSAGE_SENTENCES`, "summarize it with
  quotes", after one worked example whose summary quotes two of its sentences.

Prompts go to ``/v1/completions`` as text (few-shot, so the tiny default model copies), greedy,
with EOS honoured and a stop string, so each output is the real answer and every server writes the
same tokens. Each set's outputs are also classified once: the share of output tokens that repeat
an earlier 8-gram *of the output itself* (a loop, which inflates acceptance) is reported apart
from the rest.

    .venv/bin/python bench/spec_real_work.py --reps 2 --threads 1 --out /tmp/spec_real_work.json

(``--threads 1`` spares a crowded machine's OpenMP barriers; ``--server METHOD=URL`` reuses a
running server.)

Per (set, concurrency, method) it prints the median output tok/s over the reps, the ratio to plain,
and from the server's /metrics the draft acceptance rate and the mean accepted tokens per draft.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenline.bench.ports import free_port  # noqa: E402
from tokenline.bench.serve import BenchServeConfig, run_bench_serve, wait_healthy  # noqa: E402
from tokenline.bench.throughput import PASSAGE_SENTENCES  # noqa: E402

METHODS: dict[str, list[str]] = {
    "plain": [],
    "ngram": ["--speculative", "ngram"],
    "suffix": ["--speculative", "suffix"],
}
SOURCES = ["tokenline/spec_decode/ngram_proposer.py", "tokenline/spec_decode/mtp_proposer.py", "tokenline/bench/serve.py",
           "tokenline/engine/config.py", "tokenline/engine/factory.py", "tokenline/engine/block_pool.py",
           "tokenline/engine/kv_cache_manager.py"]
STOPS = {"code-edit": ["```"], "quotes": ["\n\n"]}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def functions(min_lines: int = 8, max_lines: int = 16) -> list[tuple[str, str]]:
    """(name, source) of top-level functions of a middling size from tokenline's own files."""
    found = []
    for rel in SOURCES:
        text = (ROOT / rel).read_text()
        lines = text.splitlines()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines and not node.decorator_list:
                    found.append((node.name, "\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return found


def rename(code: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def code_edit_prompts(count: int) -> list[str]:
    funcs = functions()
    example_name, example = funcs[0]
    shot = (f"Rename the function `{example_name}` to `new_{example_name}` and output the whole file.\n\n"
            f"File:\n```python\n{example}\n```\n\nResult:\n```python\n"
            f"{rename(example, example_name, 'new_' + example_name)}\n```\n\n")
    prompts = []
    for i in range(count):
        name, code = funcs[1 + i % (len(funcs) - 1)]
        new = f"{name}_v{i // (len(funcs) - 1) + 2}"
        prompts.append(shot + f"Rename the function `{name}` to `{new}` and output the whole file.\n\n"
                              f"File:\n```python\n{code}\n```\n\nResult:\n```python\n")
    return prompts


def quote_prompts(count: int) -> list[str]:
    sentences = PASSAGE_SENTENCES
    k = 6
    example = sentences[:k]
    shot = (f"Text: {' '.join(example)}\n\nSummary with quotes: The text describes a scene. It says: "
            f"\"{example[1]}\" It also says: \"{example[4]}\"\n\n")
    prompts = []
    for i in range(count):
        start = (k + 3 * i) % len(sentences)
        passage = [sentences[(start + j) % len(sentences)] for j in range(k)]
        prompts.append(shot + f"Text: {' '.join(passage)}\n\nSummary with quotes: The text describes a scene. It says: \"")
    return prompts


def loop_share(output_ids: list[int], n: int = 8) -> float:
    """Share of output tokens that close an n-gram seen earlier in the output itself."""
    seen: set[tuple[int, ...]] = set()
    looped = 0
    for i in range(n, len(output_ids) + 1):
        gram = tuple(output_ids[i - n : i])
        looped += gram in seen
        seen.add(gram)
    return looped / max(1, len(output_ids))


def spec_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def classify(base_url: str, prompts: list[str], stop: list[str], max_tokens: int) -> dict[str, float]:
    """One greedy pass (the plain server): mean output tokens and the loop share over all outputs."""
    from concurrent.futures import ThreadPoolExecutor

    with httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=64)) as client:
        model = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]

        def output_ids(prompt: str) -> list[int]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "stop": stop, "return_token_ids": True}
            return client.post(f"{base_url}/v1/completions", json=body).json()["choices"][0].get("token_ids") or []

        with ThreadPoolExecutor(32) as pool:  # all at once: the server batches them
            ids = list(pool.map(output_ids, dict.fromkeys(prompts)))
    total = sum(len(x) for x in ids)
    return {"mean_output_tokens": total / max(1, len(ids)),
            "loop_share": sum(loop_share(x) * len(x) for x in ids) / max(1, total)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--sets", nargs="+", default=["code-edit", "quotes"], choices=["code-edit", "quotes"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompts-c1", type=int, default=3, help="requests per run at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the servers")
    parser.add_argument("--server", action="append", default=[], metavar="METHOD=URL",
                        help="use this running server for METHOD (plain, ngram, suffix) instead of starting one")
    parser.add_argument("--out", default=None, help="JSON results, rewritten after every run")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the servers get stopped

    work = Path(tempfile.mkdtemp(prefix="spec_real_work_"))
    sets = {"code-edit": code_edit_prompts(32), "quotes": quote_prompts(32)}
    paths = {}
    for name, prompts in sets.items():
        paths[name] = work / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    servers: dict[str, tuple[str, subprocess.Popen | None]] = {}
    for item in args.server:
        method, _, url = item.partition("=")
        servers[method] = (url.rstrip("/"), None)
    try:
        for method, flags in METHODS.items():
            if method in servers:
                continue
            port = free_port()
            log = open(work / f"server-{method}.log", "wb")  # noqa: SIM115 - the server holds it
            spec = ["--num-speculative-tokens", str(args.num_speculative_tokens)] if flags else []
            command = [sys.executable, "-m", "tokenline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                       "--dtype", "float32", "--max-num-seqs", "32", "--kv-cache-memory", "1",
                       "--usage-db", str(work / f"usage-{method}.sqlite3"), "--disable-log-requests",
                       *flags, *spec]
            servers[method] = (f"http://127.0.0.1:{port}", subprocess.Popen(command, stdout=log,
                                                                            stderr=subprocess.STDOUT, env=env))
        for url, process in servers.values():
            wait_healthy(url, process, timeout=900)

        results: dict[str, Any] = {"load_before": os.getloadavg(), "runs": [], "classes": {}}
        order = list(METHODS)
        for rep in range(args.reps):
            for name in args.sets:
                for concurrency in args.concurrency:
                    for method in order[rep % 3 :] + order[: rep % 3]:  # rotate who goes first
                        url = servers[method][0]
                        before = spec_counters(url)
                        config = BenchServeConfig(
                            base_url=url, concurrency=concurrency, dataset_path=str(paths[name]),
                            workload="dataset", num_prompts=args.prompts_c1 if concurrency == 1 else concurrency,
                            output_len=args.max_tokens, extra_body={"ignore_eos": False, "stop": STOPS[name]},
                            timeout=3600,
                        )
                        report = asyncio.run(run_bench_serve(config))
                        after = spec_counters(url)
                        delta = {k.split(":")[1]: after[k] - before[k] for k in SPEC_COUNTERS}
                        row = {"set": name, "concurrency": concurrency, "method": method, "rep": rep,
                               "output_tok_s": report.output_throughput, "failed": report.failed,
                               "output_tokens": report.total_output_tokens, "tpot_p50_ms": report.tpot_ms.get("p50"),
                               "load1": os.getloadavg()[0], **delta}
                        results["runs"].append(row)
                        print(json.dumps(row), flush=True)
                        if args.out:
                            Path(args.out).write_text(json.dumps(results, indent=2))
        results["load_after"] = os.getloadavg()
        for name in args.sets:  # what the outputs were: copies, or loops?
            results["classes"][name] = classify(servers["plain"][0], sets[name], STOPS[name], args.max_tokens)
            print(name, results["classes"][name], flush=True)
    finally:
        started = [process for _, process in servers.values() if process is not None]
        for process in started:
            process.terminate()
        for process in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    print(f"\n{'set':10} {'c':>3} {'method':7} {'tok/s':>8} {'x plain':>8} {'accept':>7} {'tok/draft':>9}")
    for name in args.sets:
        for concurrency in args.concurrency:
            rows = [r for r in results["runs"] if r["set"] == name and r["concurrency"] == concurrency]
            plain = statistics.median(r["output_tok_s"] for r in rows if r["method"] == "plain")
            for method in METHODS:
                mine = [r for r in rows if r["method"] == method]
                if not mine:
                    continue
                speed = statistics.median(r["output_tok_s"] for r in mine)
                drafted = sum(r["spec_decode_num_draft_tokens_total"] for r in mine)
                accepted = sum(r["spec_decode_num_accepted_tokens_total"] for r in mine)
                drafts = sum(r["spec_decode_num_drafts_total"] for r in mine)
                accept = f"{accepted / drafted:.2f}" if drafted else "-"
                per_draft = f"{accepted / drafts:.2f}" if drafts else "-"
                print(f"{name:10} {concurrency:>3} {method:7} {speed:8.1f} {speed / plain:8.2f} {accept:>7} {per_draft:>9}")
    print(f"load: {results['load_before']} before, {results['load_after']} after")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

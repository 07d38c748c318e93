"""The overhead diagnostic's pure evidence: environment diffs, thread CPU, py-spy profiles, HAProxy stats,
and the findings read from them."""

from __future__ import annotations

import pytest

from loadtests import diag_evidence as ev


def test_env_diff_lists_what_differs_and_redacts_secrets():
    a = {"OMP_NUM_THREADS": "1", "PATH": "/bin", "HF_TOKEN": "hf_abc", "SAME": "x"}
    b = {"PATH": "/usr/bin", "HF_TOKEN": "hf_xyz", "SAME": "x", "CUDA_VISIBLE_DEVICES": "1"}
    assert ev.env_diff(a, b) == {
        "CUDA_VISIBLE_DEVICES": [None, "1"],
        "HF_TOKEN": ["<redacted>", "<redacted>"],
        "OMP_NUM_THREADS": ["1", None],
        "PATH": ["/bin", "/usr/bin"],
    }


@pytest.mark.parametrize(
    ("key", "relevant"),
    [
        ("OMP_NUM_THREADS", True),
        ("CUDA_VISIBLE_DEVICES", True),
        ("VLLM_WORKER_MULTIPROC_METHOD", True),
        ("TORCHINDUCTOR_COMPILE_THREADS", True),
        ("LD_PRELOAD", True),
        ("PATH", False),
        ("RAY_JOB_ID", False),
        ("HOME", False),
    ],
)
def test_engine_vars(key, relevant):
    assert ev.is_engine_var(key) is relevant
    assert (key in ev.engine_vars({key: ["a", "b"]})) is relevant


def test_thread_cpu_by_name_groups_threads_and_counts_new_ones_from_zero():
    before = {1: ("EngineCore", 1.0), 2: ("ZMQbg/IO/0", 0.5), 3: ("ended", 9.0)}
    after = {1: ("EngineCore", 1.4), 2: ("ZMQbg/IO/0", 0.5), 4: ("EngineCore", 0.2)}
    assert ev.thread_cpu_by_name(before, after) == [
        {"thread": "EngineCore", "threads": 2, "cpu_s": 0.6},
        {"thread": "ZMQbg/IO/0", "threads": 1, "cpu_s": 0.0},
    ]


def test_pyspy_profile_counts_busy_samples_per_thread_and_leaf():
    raw = [
        "thread (8226): spinner;Thread._bootstrap (threading.py:1002);spin (<string>:4) 90",
        "thread (8226): spinner;Thread._bootstrap (threading.py:1002);other (<string>:9) 10",
        "thread (8225): MainThread;<module> (<string>:6) 5",
        "not a profile line",
    ]
    assert ev.pyspy_profile(raw) == {
        "spinner": {"samples": 100, "top": [["spin (<string>:4)", 90], ["other (<string>:9)", 10]]},
        "MainThread": {"samples": 5, "top": [["<module> (<string>:6)", 5]]},
    }


def test_frame_share_counts_a_frame_anywhere_on_the_stack_of_the_named_threads_only():
    raw = [
        "thread (1): AsyncIO Thread: default;record (loggers.py:1219);observe (metrics.py:133) 6",
        "thread (1): AsyncIO Thread: default;send (httptools_impl.py:542) 3",
        "thread (1): AsyncIO Thread: default;record (loggers.py:1200) 1",
        "thread (2): MainThread;record (loggers.py:1219) 50",
        "not a profile line",
    ]
    assert ev.frame_share(raw, "AsyncIO Thread", ["loggers.py:1219", "metrics.py:133", "absent"]) == {
        "loggers.py:1219": [6, 10],
        "metrics.py:133": [6, 10],
        "absent": [0, 10],
    }
    assert ev.frame_share(raw, "MainThread", ["loggers.py:1219"]) == {"loggers.py:1219": [50, 50]}


def test_share_command_prints_each_frame_with_its_share(tmp_path, capsys):
    profile = tmp_path / "p.txt"
    profile.write_text("thread (2): MainThread;a (x.py:1) 3\nthread (2): MainThread;b (x.py:2) 1\n")
    assert ev.main(["share", str(profile), "--thread", "MainThread", "--frame", "x.py:1"]) == 0
    assert capsys.readouterr().out == "p.txt\tMainThread\tx.py:1\t3 of 4 samples\t75.0%\n"


# HAProxy's CSV (columns cut after `bck`; HAProxy has more, read by name).
STATS = """# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,\
wredis,status,weight,act,bck
http_frontend,FRONTEND,,,0,2,4096,120,0,0,0,0,0,,,,,OPEN,,,
http-headroom,SERVE_REPLICA_headroom-LLMServer-abc,0,0,0,1,,118,0,0,,0,,0,0,0,0,UP,1,1,0
http-headroom,SERVE_PROXY_ACTOR-fallback,0,0,0,0,,2,0,0,,0,,0,0,0,0,UP,1,0,1
http-headroom,BACKEND,0,0,0,1,410,120,0,0,0,0,,0,0,0,0,UP,1,1,1
stats,FRONTEND,,,1,1,4096,3,0,0,0,0,0,,,,,OPEN,,,
"""


def test_haproxy_servers_reads_backend_servers_and_marks_the_backup():
    assert ev.haproxy_servers(STATS) == [
        {
            "backend": "http-headroom",
            "server": "SERVE_REPLICA_headroom-LLMServer-abc",
            "sessions_total": 118,
            "backup": False,
            "status": "UP",
        },
        {
            "backend": "http-headroom",
            "server": "SERVE_PROXY_ACTOR-fallback",
            "sessions_total": 2,
            "backup": True,
            "status": "UP",
        },
    ]


def test_backup_sessions_counts_only_what_the_backup_took_in_between():
    before = ev.haproxy_servers(STATS)
    after = [dict(r, sessions_total=r["sessions_total"] + (5 if r["backup"] else 100)) for r in before]
    assert ev.backup_sessions(before, after) == 5
    assert ev.backup_sessions(before, before) == 0


def sweep(deltas: dict[int, float], rounds: int = 3) -> list[dict]:
    """Measurements where headroom's TTFT p50 exceeds bare's by deltas[length] (+r ms of noise in round r)."""
    rows = []
    for r in range(rounds):
        for n, d in deltas.items():
            rows.append({"round": r, "input_len": n, "server": "vllm", "ttft_p50_ms": 40.0})
            rows.append({"round": r, "input_len": n, "server": "headroom", "ttft_p50_ms": 40.0 + d + r})
    return rows


def test_ttft_deltas_pair_rounds_and_take_the_median():
    assert ev.ttft_deltas(sweep({50: 0.5, 1024: 9.0})) == {50: 1.5, 1024: 10.0}
    lone = [{"round": 0, "input_len": 50, "server": "headroom", "ttft_p50_ms": 1.0}]
    assert ev.ttft_deltas(lone) == {}


def test_graph_boundary_finding_says_whether_the_delta_jumps_past_512_tokens():
    jump = ev.graph_boundary_finding({50: 0.8, 448: 1.0, 576: 7.5, 1024: 9.0})
    assert jump is not None and "jumps: the extra time is in eager" in jump and "+6.5 ms" in jump
    flat = ev.graph_boundary_finding({50: 0.8, 448: 1.0, 576: 1.2, 1024: 0.9})
    assert flat is not None and "does not jump" in flat
    assert ev.graph_boundary_finding({50: 0.8, 448: 1.0}) is None  # nothing past the ceiling measured


def test_swap_finding_tells_server_from_gpu():
    assert "follows the server" in (ev.swap_finding({50: 1.0, 1024: 9.0}, {50: 1.5, 1024: 8.0}) or "")
    assert "follows the GPU" in (ev.swap_finding({50: 1.0, 1024: 9.0}, {50: -8.0, 1024: -9.0}) or "")
    assert ev.swap_finding({50: 1.0}, {}) is None


def test_ratio_finding():
    assert (
        ev.ratio_finding("engine-core CPU", 2.0, 5.0, "ms")
        == "engine-core CPU: bare 2.0 ms, headroom 5.0 ms (x2.50)."
    )
    assert ev.ratio_finding("engine-core CPU", None, 5.0, "ms") is None


def core(**overrides) -> dict:
    facts = {
        "nice": 0,
        "affinity": [0, 1],
        "sched_policy": 0,
        "num_threads": 15,
        "thread_names": {"VLLM::EngineCor": 5, "ZMQbg/IO/0": 4},
        "environ": {"OMP_NUM_THREADS": "1"},
    }
    return facts | overrides


def test_process_findings_name_each_difference():
    findings = ev.process_findings(
        {
            "vllm": core(environ={}),
            "headroom": core(
                nice=15, num_threads=19, thread_names={"VLLM::EngineCor": 5, "grpc_global_tim": 4}
            ),
        }
    )
    assert findings == [
        "engine core niceness differs: bare 0, headroom 15.",
        "engine core environment differs in engine-relevant variables: OMP_NUM_THREADS: bare None, "
        "headroom '1'.",
        "engine core threads: bare 15, headroom 19; only in headroom: grpc_global_tim.",
    ]


def test_process_findings_when_an_environment_is_unreadable_or_equal():
    unreadable = ev.process_findings({"vllm": core(environ=None), "headroom": core()})
    assert unreadable[0].startswith("engine core environment: bare's is unreadable")
    assert "OMP_NUM_THREADS='1'" in unreadable[0]
    assert ev.process_findings({"vllm": core(), "headroom": core()}) == [
        "engine core environment: no engine-relevant variable differs."
    ]
    assert ev.process_findings({"vllm": core()}) == []

"""benchmarks.harness: fresh worker processes (results, failures, timeout, RSS limit),
argument types, and that `benchmarks` is not installed with the library."""

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A stand-in for `python -m benchmarks.<tool> --worker ... --out PATH` (no TensorFlow).
FAKE_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from benchmarks import harness

    args = sys.argv[1:]
    out = args[args.index("--out") + 1]
    what = os.environ["FAKE"].split(",")[harness.task_index() if "TF_CONFIG" in os.environ else 0]
    print("[fake_worker] started", file=sys.stderr, flush=True)
    print("noise on stderr", file=sys.stderr, flush=True)
    if what == "ok":
        harness.write_result(out, {"argv": args, "task": os.environ.get("TF_CONFIG", "")})
    elif what == "hold":
        harness.write_result(out, {"held": True})
        open(os.path.join(os.environ["FAKE_DIR"], "held"), "w").close()
        harness.hold_then_exit()
    elif what == "fail":
        sys.exit(5)
    elif what == "fail_once_held":  # fails once a "hold" worker has its result
        for _ in range(500):
            if os.path.exists(os.path.join(os.environ["FAKE_DIR"], "held")):
                break
            time.sleep(0.1)
        sys.exit(5)
    elif what == "sleep":
        time.sleep(60)
    elif what == "grow":
        block = bytearray(300 * 1024 * 1024)
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(60)
    """
)


@pytest.fixture
def fake(tmp_path):
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    pythonpath = os.pathsep.join([str(tmp_path), ROOT])

    def run(behaviours, cluster=False, **kwargs):
        envs = harness.tf_config_envs(len(behaviours)) if cluster else [{}]
        envs = [dict(env, FAKE=",".join(behaviours), FAKE_DIR=str(tmp_path), PYTHONPATH=pythonpath)
                for env in envs]
        return harness.run_workers(harness.Progress("fake_worker"), ["--x", "1"], envs, **kwargs)

    return run


@pytest.mark.fast
def test_a_worker_result_comes_back_with_its_progress_lines(fake, capfd):
    run, = fake(["ok"])
    assert run.code == 0 and run.killed is None
    assert run.result["argv"][:3] == ["--worker", "--x", "1"]
    assert run.peak_rss_kib > 0
    err = capfd.readouterr().err
    assert "[fake_worker] started" in err and "noise" not in err  # progress forwarded
    assert "noise on stderr" in run.tail and "[fake_worker]" not in run.tail
    assert harness.require_results([run], "fake") == [run.result]


def test_a_cluster_holds_until_every_worker_has_a_result(fake):
    runs = fake(["hold", "hold"], cluster=True, timeout=60)
    assert [r.code for r in runs] == [0, 0]
    assert [r.result for r in runs] == [{"held": True}] * 2


def test_a_failing_cluster_worker_stops_the_others(fake, capfd):
    # Worker 0 would wait for worker 1 forever (as in an all-reduce): it is killed.
    runs = fake(["sleep", "fail"], cluster=True, timeout=60)
    assert runs[1].code == 5 and runs[1].killed is None and runs[1].result is None
    assert runs[0].killed == "peer" and runs[0].code < 0 and runs[0].result is None
    with pytest.raises(RuntimeError, match=r"^fake: worker 1 failed with exit code 5 "):
        harness.require_results(runs, "fake")
    assert "noise on stderr" in capfd.readouterr().err  # the failed worker's tail
    # A worker that already has its result is left to finish.
    runs = fake(["hold", "fail_once_held"], cluster=True, timeout=60)
    assert runs[0].code == 0 and runs[0].result == {"held": True} and runs[0].killed is None
    with pytest.raises(RuntimeError, match=r"^fake: worker 1 failed with exit code 5 "):
        harness.require_results(runs, "fake")


def test_timeout_kills_the_worker(fake):
    run, = fake(["sleep"], timeout=1)
    assert run.killed == "timeout" and run.result is None
    with pytest.raises(RuntimeError, match="fake did not finish within 1 s"):
        harness.require_results([run], "fake", timeout=1)


def test_rss_limit_kills_the_worker(fake):
    run, = fake(["grow"], rss_abort_bytes=150 * 1024 * 1024, timeout=60)
    assert run.killed == "memory" and run.result is None
    assert run.failure() == "killed by the parent's memory backstop"
    assert run.peak_rss_kib > 150 * 1024


@pytest.mark.parametrize("parse, text, message", [
    (harness.positive_int, "0", "expected a positive integer, got '0'"),
    (harness.positive_float, "nan", "expected a positive number, got 'nan'"),
    (harness.float_above(1.0), "1", "expected a number > 1, got '1'"),
    (harness.fraction, "1", "expected a number in [0, 1), got '1'"),
    (harness.int_list, "2,x", "expected comma-separated positive integers such as 2,6, got '2,x'"),
    (harness.int_list, "2,2", "expected distinct values, got '2,2'"),
    (harness.name_list(("a", "b")), "a,c", "expected a comma-separated list of distinct names "
                                           "from a,b, got 'a,c'"),
])
def test_argument_types_say_what_was_expected(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{message.replace('[', '.').replace(')', '.')}$"):
        parse(text)


def test_argument_types_parse():
    assert harness.int_list(" 2, 6") == (2, 6)
    assert harness.name_list(("0", "1"))("1,0") == ("1", "0")
    assert harness.slope([(1, 3.0), (2, 5.0), (3, 7.0)]) == pytest.approx((2.0, 1.0))
    assert harness.lower_median([3, 1, 2, 4]) == 2


def test_benchmarks_are_not_installed(tmp_path):
    # setup.py's packages: the library only; the tools run from a checkout.
    out = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    info = next(tmp_path.glob("*.egg-info"))
    assert (info / "top_level.txt").read_text().split() == ["accum", "recompute"]
    assert "benchmarks/" not in (info / "SOURCES.txt").read_text()


def test_report_to_docs_replaces_the_block_and_keeps_the_rest(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n<!-- benchmarks.tool -->\nold figures\n<!-- /benchmarks.tool -->\n\nprose\n")
    with harness.report_to_docs(str(page), "benchmarks.tool", ["--quick", "a b"]):
        print("new figures")
        print("x1.23")
    assert capsys.readouterr().out == "new figures\nx1.23\n"  # printed as well
    text = page.read_text()
    assert text.startswith("# Title\n\n<!-- benchmarks.tool -->\n`python -m benchmarks.tool --quick 'a b'`, run ")
    assert "```text\nnew figures\nx1.23\n```\n<!-- /benchmarks.tool -->\n\nprose\n" in text
    assert "old figures" not in text
    with harness.report_to_docs(None, "benchmarks.tool"):  # no page: only printed
        print("again")
    assert capsys.readouterr().out == "again\n" and page.read_text() == text


def test_docs_page_without_its_block_is_refused_before_the_run(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("<!-- benchmarks.other -->\n<!-- /benchmarks.other -->\n")
    parser = argparse.ArgumentParser(prog="tool")
    for path in (page, tmp_path / "missing.md"):
        with pytest.raises(SystemExit):
            harness.check_docs_page(parser, str(path), "benchmarks.tool")
    err = capsys.readouterr().err
    assert "expected one line `<!-- benchmarks.tool -->` followed by one line `<!-- /benchmarks.tool -->`" in err
    assert "missing.md" in err
    harness.check_docs_page(parser, None, "benchmarks.tool")  # no --docs: nothing to check


def test_every_docs_block_names_a_benchmark_that_can_write_it():
    import re

    for name in os.listdir(os.path.join(ROOT, "docs")):
        if not name.endswith(".md"):  # plots
            continue
        with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
            text = f.read()
        for tool in re.findall(r"^<!-- (benchmarks\.\w+) -->$", text, re.M):
            harness._docs_block(text, tool)  # one well-formed block
            block = text.split(f"<!-- {tool} -->")[1].split(f"<!-- /{tool} -->")[0]
            fences = re.findall(r"```text\n(.*?)```", block, re.S)
            assert block.strip() and all(f.strip() for f in fences), (name, tool, "an empty report")
            with open(os.path.join(ROOT, *tool.split(".")) + ".py", encoding="utf-8") as f:
                assert "harness.report_to_docs(args.docs, TOOL" in f.read(), tool


def test_reports_print_to_the_stdout_of_the_call():
    """`report_to_docs` captures what is printed to `sys.stdout` while it runs: a
    report whose `out` defaulted to the `sys.stdout` of import time would escape it."""
    import importlib
    import inspect

    for tool in ("batchfit", "recompute_memory", "recompute_distribute"):
        module = importlib.import_module(f"benchmarks.{tool}")
        assert inspect.signature(module.print_report).parameters["out"].default is None, tool


@pytest.mark.parametrize("choice, tunables, bfc", [
    ("default", "glibc.malloc.arena_max=2", None),
    ("hugepages", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", None),
    ("tf-bfc", "glibc.malloc.arena_max=2", "1"),
])
def test_malloc_env_sets_one_allocation_and_keeps_other_tunables(monkeypatch, choice, tunables, bfc):
    # Started from the opposite settings: each choice must undo the others.
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "1")
    env = harness.malloc_env(choice)
    assert env == {"GLIBC_TUNABLES": tunables, "TF_CPU_ALLOCATOR_USE_BFC": bfc}
    worker = harness.worker_env(**env)
    for key, value in env.items():
        monkeypatch.delenv(key, raising=False)
        if key in worker:
            monkeypatch.setenv(key, worker[key])
    assert harness.malloc_setting() == choice


def test_malloc_env_refuses_an_unknown_choice():
    with pytest.raises(ValueError, match=r"`malloc` must be one of default, hugepages, tf-bfc\. "
                                         r"Received: malloc='jemalloc'"):
        harness.malloc_env("jemalloc")


def test_held_peak_replays_the_marked_step():
    """`benchmarks.held.peak`: only the tensors allocated after the last mark, alive
    together at their largest, grouped by their op's name with digits as `#`."""
    from benchmarks import held

    def alloc(op, size, i):
        return (f'I0 log_memory.cc:34] __LOG_MEMORY__ MemoryLogTensorAllocation {{ goo.gle/x '
                f'step_id: 3 kernel_name: "{op}" tensor {{ dtype: DT_FLOAT shape {{ dim {{ size: 2 }} }} '
                f'allocation_description {{ requested_bytes: {size} allocated_bytes: {size} '
                f'allocator_name: "cpu" allocation_id: {i} has_single_reference: true ptr: 1 }} }} }}')

    def free(i):
        return (f'I0 log_memory.cc:34] __LOG_MEMORY__ MemoryLogTensorDeallocation {{ goo.gle/x '
                f'allocation_id: {i} allocator_name: "cpu" }}')

    lines = [alloc("before/MatMul", 10_000, 1), held.MARK, free(1),
             alloc("block_1/ffn/MatMul", 100, 2), alloc("block_2/ffn/MatMul", 100, 3),
             alloc("tmp", 50, 4), free(4), alloc("grad", 30, 5), free(2), free(3),
             alloc("late", 200, 6)]
    result = held.peak(lines)
    assert result["peak_bytes"] == 250  # 100 + 100 + 50, not 230 (after tmp) nor 200 (late)
    assert result["groups"] == {"block_#/ffn/MatMul": [200, 2], "tmp": [50, 1]}
    assert held.per_sample(dict(groups={"a": [100, 1]}), dict(groups={"a": [500, 1], "b": [40, 1]}),
                           (2, 6)) == {"a": 100.0, "b": 10.0}
    with pytest.raises(ValueError, match="no line"):
        held.peak(lines[2:])
    with pytest.raises(ValueError, match="no tensor allocated after its mark"):
        held.peak([alloc("x", 1, 1), held.MARK])

"""Every ``sarp`` command with bad input: exit code 2, one line on stderr naming the
value (and the fix), no traceback, and nothing created, before any work starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sarp.cli import main

OK_SOURCE = "e=tcp://127.0.0.1:9"


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, a text the one line must name)."""
    ix = str(tmp / "ix")
    (tmp / "a-file").write_text("")
    (tmp / "a-folder").mkdir()
    (tmp / "existing").mkdir()
    missing = str(tmp / "missing.jsonl")
    (tmp / "not-a-trace.jsonl").write_text("hello\n")
    (tmp / "not-gzip.jsonl.gz").write_text('{"hash_ids": [1]}\n')
    bad_lines, bad_gzip = str(tmp / "not-a-trace.jsonl"), str(tmp / "not-gzip.jsonl.gz")
    serve = ["serve", "--index", ix, "--source", OK_SOURCE]
    return [
        # serve
        (["serve", "--index", ix, "--source", "eng=127.0.0.1:5557"], "tcp://127.0.0.1:5557"),
        (["serve", "--index", ix, "--source", "eng"], "'eng'"),
        (["serve", "--index", ix, "--source", "e=tcp://127.0.0.1:99999"], "99999"),
        (["serve", "--index", ix, "--source", "e=http://127.0.0.1:5557"], "http://"),
        (["serve", "--index", "valkey:/127.0.0.1:6379/ns", "--source", OK_SOURCE],
         "valkey://HOST:PORT/NAMESPACE"),
        (["serve", "--index", "valkey://127.0.0.1:6379/", "--source", OK_SOURCE], "namespace"),
        (["serve", "--index", str(tmp / "a-file" / "ix"), "--source", OK_SOURCE], "a-file"),
        (["serve", "--index", str(tmp / "a-file"), "--source", OK_SOURCE], "a-file"),
        ([*serve, "--block-size", "-3"], "'-3'"),
        ([*serve, "--block-size", "70000"], "'70000'"),
        ([*serve, "--source", OK_SOURCE], "e named twice"),
        ([*serve, "--dp-ranks", "0"], "'0'"),
        ([*serve, "--shard", "a"], "--shard a needs a sharded index on Valkey"),
        (["serve", "--index", "valkey://127.0.0.1:6379/ns", "--source", OK_SOURCE,
          "--shard", "a/b"], "'a/b'"),
        ([*serve, "--http", "127.0.0.1"], "'127.0.0.1'"),
        ([*serve, "--http", "127.0.0.1:8080", "--http-workers", "-1"], "'-1'"),
        (["serve", "--index", "valkey://127.0.0.1:9/ns", "--source", OK_SOURCE, "--http",
          "127.0.0.1:8080", "--http-workers", "0"], "--http-workers 0 answers from serve's own"),
        ([*serve, "--dead-after-s", "-1"], "'-1'"),
        ([*serve, "--replay-budget-s", "nan"], "'nan'"),
        ([*serve, "--max-frame-bytes", "10"], "'10'"),
        ([*serve, "--commit-wait-ms", "30"], "'30'"),
        ([*serve, "--commit-wait-ms", "-1"], "'-1'"),
        ([*serve, "--sources-file", missing], "missing.jsonl"),
        ([*serve, "--http-token-file", str(tmp / "a-folder")], "a-folder"),
        ([*serve, "--hash-scheme", "md5"], "'md5'"),
        ([*serve, "--model-name", "llama"], "--block-size"),
        (["serve", "--source", OK_SOURCE], "--index"),
        # bench
        (["bench", "--trace", missing], "missing.jsonl"),
        (["bench", "--trace", str(tmp / "a-folder")], "is a folder"),
        (["bench", "--limit-requests", "0"], "'0'"),
        (["bench", "--indexes", "sarp,bogus"], "bogus"),
        (["bench", "--passes", "0"], "'0'"),
        (["bench", "--pass-s", "0"], "'0'"),
        (["bench", "--split", "x"], "'x'"),
        (["bench", "--workdir", str(tmp / "a-file")], "a-file"),
        (["bench", "--trace", bad_lines, "--indexes", "sarp"], "not-a-trace.jsonl:1"),
        (["bench", "--trace", bad_gzip, "--indexes", "sarp"], "not-gzip.jsonl.gz"),
        (["workingset", "--trace", bad_lines], "not-a-trace.jsonl:1"),
        (["cluster", "--trace", bad_gzip], "not-gzip.jsonl.gz"),
        # bench-events
        (["bench-events", "--rates", "1000,-5"], "1000,-5"),
        (["bench-events", "--engines", "0"], "'0'"),
        (["bench-events", "--repeat", "0"], "'0'"),
        (["bench-events", "--trace", missing], "missing.jsonl"),
        (["bench-events", "--index", ix], "not a Valkey URL"),
        # cluster
        (["cluster", "--drop-rate", "1.5"], "'1.5'"),
        (["cluster", "--policies", "sarp,nope"], "sarp,nope"),
        (["cluster", "--capacity-blocks", "0"], "'0'"),
        # workingset
        (["workingset"], "--trace"),
        (["workingset", "--trace", missing], "missing.jsonl"),
        (["workingset", "--trace", missing.replace("missing", "x"), "--sample-rate", "0"],
         "x.jsonl"),
        # verify, stats, repair
        (["verify", str(tmp / "nothing")], "nothing"),
        (["verify", "valkey:/127.0.0.1:6379/ns"], "valkey:/127.0.0.1:6379/ns"),
        (["stats", str(tmp / "nothing")], "nothing"),
        (["stats", "valkey://127.0.0.1:notaport/ns"], "port"),
        (["repair", str(tmp / "nothing"), "--out", str(tmp / "new")], "nothing"),
        (["repair", str(tmp / "existing"), "--out", str(tmp / "existing")], "exists"),
        # no command, unknown command
        ([], "command"),
        (["serv"], "'serv'"),
    ]


def test_every_command_refuses_bad_input_in_one_line_with_exit_2(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.chdir(tmp_path)  # a URL taken for a folder would be made here
    cases = _cases(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, named in cases:
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's refusal
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, (argv, code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        assert "Traceback" not in err and named in lines[0], (argv, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, (argv, "created")
    assert len(cases) >= 50


def test_a_refusal_as_a_user_sees_it(tmp_path):
    """The same refusal from the installed command: a real process, one line, exit 2."""
    out = subprocess.run([sys.executable, "-m", "sarp.cli", "serve", "--index",
                          str(tmp_path / "ix"), "--source", "eng=127.0.0.1:5557"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "sarp serve: argument --source: source 'eng=127.0.0.1:5557': endpoint "
        "'127.0.0.1:5557' has no transport; write tcp://127.0.0.1:5557 (sarp serve --help "
        "lists the options)")
    assert not (tmp_path / "ix").exists()


def test_version_and_help_show_the_version_the_path_and_every_default():
    out = subprocess.run([sys.executable, "-m", "sarp.cli", "--version"], capture_output=True,
                         text=True, timeout=60)
    import sarp
    import sarp.native

    assert out.returncode == 0
    assert out.stdout.strip() == (f"sarp {sarp.__version__} (hot loops in "
                                  f"{'C' if sarp.native.C is not None else 'Python'})")
    # the parsers cost no import of the service or the benchmarks (serve's start-up)
    probe = ("import sys, sarp.cli as c\ntry:\n    c.main(['--version'])\nexcept SystemExit:"
             "\n    pass\nprint(sorted(m for m in sys.modules if m.startswith(('sarp.bench', "
             "'sarp.serving'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60).stdout.strip().splitlines()[-1]
    assert loaded == "[]", loaded
    for command in ("serve", "bench", "bench-events", "cluster", "workingset", "verify",
                    "stats", "repair"):
        text = subprocess.run([sys.executable, "-m", "sarp.cli", command, "--help"],
                              capture_output=True, text=True, timeout=60).stdout
        assert "usage: sarp " + command in text
        if command == "serve":
            assert "(default: 10.0)" in text and "(default: vllm-sha256)" in text
    # every option of every command says what it is for
    from sarp.argcheck import Parser

    parser = Parser(prog="sarp")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    import sarp.cli as cli

    for add in (cli._bench_parser, cli._workingset_parser, cli._serve_parser,
                cli._cluster_parser, cli._bench_events_parser, cli._repair_parser,
                cli._verify_and_stats_parser):
        add(sub)
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.dest != "help":
                assert action.help, (name, action.dest)


def test_stats_a_closed_pipe_is_no_traceback(tmp_path):
    import sarp

    with sarp.open(tmp_path / "ix", durability="nosync") as index:
        index.insert([1, 2, 3], holder="e")
    out = subprocess.run(f"{sys.executable} -m sarp.cli stats {tmp_path / 'ix'} | head -1",
                         shell=True, capture_output=True, text=True, timeout=60)
    assert out.stdout == "{\n" and out.stderr == ""


@pytest.mark.slow
def test_stats_beside_a_running_serve_reports_serves_counters(tmp_path):
    from servekit import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sarp.cli", "serve", "--index",
                             str(tmp_path / "ix"), "--source", f"e=tcp://127.0.0.1:{port}",
                             "--durability", "nosync", "--probe-after-s", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run([sys.executable, "-m", "sarp.cli", "stats",
                                  str(tmp_path / "ix")], capture_output=True, text=True,
                                 timeout=60)
            if out.returncode == 0 and "serve" in json.loads(out.stdout):
                break
            assert time.monotonic() < deadline, out.stderr
            time.sleep(0.2)
        serve = json.loads(out.stdout)["serve"]
        assert serve["pid"] == proc.pid and "e" in serve["sources"]
        assert serve["heartbeat_age_s"] < 10
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = subprocess.run([sys.executable, "-m", "sarp.cli", "stats", str(tmp_path / "ix")],
                         capture_output=True, text=True, timeout=60)
    assert "serve" not in json.loads(out.stdout)  # stopped: no counters of a serve gone
    assert os.path.exists(tmp_path / "ix")

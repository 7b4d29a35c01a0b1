"""/proc/PID/stat as `swarmnode.procstat` reads it: a command name with spaces and parentheses, zombies, and
processes that are gone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from swarmnode import procstat

# the first 24 fields of a stat line; comm holds ") (", so only the last ")" ends it
LINE = "4242 (a) (b c) Z 7 9 9 0 -1 4194560 0 0 0 0 {utime} {stime} 0 0 20 0 1 0 123456 0 0\n"


def test_a_stat_line_parses_past_a_command_name_with_parentheses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "stat").write_text(LINE.format(utime=3 * tick, stime=tick))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    monkeypatch.setattr(procstat, "_PROC", tmp_path)
    stat = procstat.proc_stat(4242)
    assert stat == procstat.ProcStat(4242, "a) (b c", "Z", 7, 9, 4.0, 123456)
    assert stat.zombie
    assert procstat.processes() == [stat]
    assert procstat.proc_stat(4243) is None


def test_this_process_is_listed_and_no_proc_lists_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    me = procstat.proc_stat(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.pgid == os.getpgid(0) and not me.zombie
    assert os.getpid() in {proc.pid for proc in procstat.processes()}
    monkeypatch.setattr(procstat, "_PROC", Path("/no/proc/here"))
    assert procstat.processes() == []

"""``sqllocker run`` stops everything its command started, however it started it, on every
backend: grandchildren that outlive the command, daemons that left the process group
(``setsid``), and a family whose sqllocker was stopped (SIGSTOP) past its lock's deadline, before
anyone else can hold the lock. Real processes throughout; Linux (``/proc``, a child subreaper)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sqllocker import Lock, Locker
from tests.helpers import stop_outside_a_write
from tests.test_cli import SQLLOCKER, Run, alive, migrated, popen, run_job, sqllocker, wait_until

__all__ = ["migrated", "sqllocker"]  # fixtures, used by name

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path("/proc/self/stat").exists(), reason="the family is found through /proc (Linux)"
    ),
]

# A process that ignores SIGTERM, leaves the process group and the session (``os.setsid``),
# writes its pid to argv[1], and then, while it lives, the time (CLOCK_MONOTONIC, one clock for
# every process of the machine) to argv[2] every 20 ms: a daemon that a stop must still reach.
STUBBORN_DAEMON = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.setsid()
with open(sys.argv[1], "a") as out:
    out.write(f"{os.getpid()}\\n")
while True:
    with open(sys.argv[2], "a") as out:
        out.write(f"{time.monotonic()}\\n")
    time.sleep(0.02)
"""


def daemon(pids: Path, beats: Path) -> str:
    """The shell words that run STUBBORN_DAEMON (a script puts them in the background)."""
    return f"{sys.executable} -c '{STUBBORN_DAEMON}' {pids} {beats}"


def pids_in(path: Path, count: int) -> list[int]:
    wait_until(lambda: path.exists() and len(path.read_text().split()) >= count)
    return [int(pid) for pid in path.read_text().split()]


@pytest.fixture
def reap_leftovers(tmp_path: Path) -> Iterator[list[int]]:
    """Pids a test started; whatever of them still runs at the end is killed (a failed test
    must not leave a stubborn daemon behind)."""
    started: list[int] = []
    yield started
    for pid in started:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_kill_after_reaches_a_grandchild_when_the_command_dies_of_sigterm(
    migrated: Locker,
    url: str,
    table_name: str,
    sqllocker: Run,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """The command dies of the SIGTERM at once; its grandchild ignores it, and must still get
    the SIGKILL ``--kill-after`` seconds later."""
    pids = tmp_path / "pids"
    script = f"sh -c \"trap '' TERM; echo \\$\\$ >> {pids}; exec sleep 60\" & wait"
    runner = run_job(url, table_name, "--expires 3 --kill-after 1", script)
    (grandchild,) = pids_in(pids, 1)
    reap_leftovers.append(grandchild)
    assert sqllocker("release", "job", "--force").returncode == 0
    runner.wait(timeout=30)
    assert runner.returncode == 75
    wait_until(lambda: not alive(grandchild), timeout=10)


@pytest.mark.parametrize("how", ["lock broken", "sqllocker killed"])
def test_a_daemon_that_left_the_group_is_stopped_with_the_family(
    migrated: Locker,
    url: str,
    table_name: str,
    sqllocker: Run,
    tmp_path: Path,
    reap_leftovers: list[int],
    how: str,
) -> None:
    pids, beats = tmp_path / "pids", tmp_path / "beats"
    # The daemon is started by a subshell that exits at once: a double fork, so that it is
    # nobody's child but the subreaper's, in a session of its own.
    script = f"( {daemon(pids, beats)} & ); echo $$ >> {pids}; sleep 60"
    runner = run_job(url, table_name, "--expires 3 --kill-after 1", script)
    family = pids_in(pids, 2)
    reap_leftovers.extend(family)
    if how == "lock broken":
        assert sqllocker("release", "job", "--force").returncode == 0
        runner.wait(timeout=30)
        assert runner.returncode == 75
    else:
        runner.kill()
        runner.wait(timeout=30)
    wait_until(lambda: not any(alive(pid) for pid in family), timeout=15)


def test_what_the_command_leaves_running_is_stopped_before_the_lock_is_released(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """A daemonising command returns at once; its daemon must not run on without the lock."""
    pids, beats = tmp_path / "pids", tmp_path / "beats"
    runner = run_job(url, table_name, "--kill-after 1", f"( {daemon(pids, beats)} & ); sleep 0.5")
    (stubborn,) = pids_in(pids, 1)
    reap_leftovers.append(stubborn)
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 0, err
    released = time.monotonic()
    assert migrated.lock_info("job") is None
    assert not alive(stubborn)
    assert float(beats.read_text().split()[-1]) < released


def take_over_at_expiry(locker: Locker, lockstring: str) -> Lock:
    """The lock, taken the moment its row expires (``locker`` has no grace): tried every 10 ms,
    since a waiter's own polling may notice later than that."""
    deadline = time.monotonic() + 30
    while (lock := locker.try_lock(lockstring)) is None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return lock


@pytest.mark.parametrize("attempt", range(2))
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_stopped_or_killed_sqllocker_has_its_family_gone_before_anyone_else_holds_the_lock(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
    how: str,
    attempt: int,
) -> None:
    """sqllocker is frozen (SIGSTOP) or killed while its command runs: nothing renews the lock,
    and the watchdog must stop the whole family, a daemon that ignores SIGTERM included and
    whatever --kill-after says, before the lock can be taken over (here by a Locker with no
    grace, the moment the row expires)."""
    pids, beats = tmp_path / "pids", tmp_path / "beats"
    script = (
        f"trap '' TERM; echo $$ >> {pids}; {daemon(pids, beats)} & sleep 60 & "
        f"echo $! >> {pids}; wait"
    )
    runner = run_job(url, table_name, "--expires 3 --kill-after 30", script)
    family = pids_in(pids, 3)
    reap_leftovers.extend(family)
    wait_until(lambda: beats.exists())
    if how == "stopped":
        stop_outside_a_write(runner.pid, url)
    else:
        os.kill(runner.pid, signal.SIGKILL)
    try:
        second = take_over_at_expiry(migrated, "job")
        took_over = time.monotonic()
        still_running = [pid for pid in family if alive(pid)]
        second.unlock()
    finally:
        os.kill(runner.pid, signal.SIGCONT)
    assert still_running == []
    assert float(beats.read_text().split()[-1]) < took_over
    assert runner.wait(timeout=30) == (75 if how == "stopped" else -signal.SIGKILL)


# A command that stops itself (SIGTSTP) over and over, ticking in between, continued each time
# by a process of a session of its own (argv[2]: that process's own code).
STOPS_ITSELF = """
import os, signal, subprocess, sys
me = os.getpid()
subprocess.Popen([sys.executable, "-c", sys.argv[2] % me], start_new_session=True)
with open(sys.argv[1], "a") as out:
    out.write(f"{me}\\n")
    out.flush()
    while True:
        out.write("x")
        out.flush()
        os.kill(me, signal.SIGTSTP)
"""
CONTINUES_IT = """
import os, signal, time
while True:
    try:
        os.kill(%d, signal.SIGCONT)
    except ProcessLookupError:
        break
    time.sleep(0.0005)
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])  # the watchdog's doing: any backend
def test_a_command_stopped_and_continued_over_and_over_never_holds_up_its_watchdog(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """While sqllocker is stopped, its command is stopped (by a terminal's stop signal) and
    continued thousands of times: the watchdog, which tells sqllocker of such a stop, must not
    fill the pipe sqllocker does not read and block on it, and must stop the family at the
    lock's deadline, before anyone else holds the lock."""
    log, script, helper = tmp_path / "ticks", tmp_path / "stops_itself.py", tmp_path / "helper"
    script.write_text(STOPS_ITSELF)
    helper.write_text(CONTINUES_IT)
    command_line = f'exec {sys.executable} {script} {log} "$(cat {helper})"'
    # An expiry longer than the stops take to fill the pipe, so that a blocked watchdog shows.
    runner = run_job(url, table_name, "--expires 8", command_line)
    wait_until(lambda: log.exists() and log.read_text().count("x") > 2)
    command = int(log.read_text().split()[0])
    reap_leftovers.append(command)
    stop_outside_a_write(runner.pid, url)
    try:
        second = take_over_at_expiry(migrated, "job")
        running = alive(command)
        second.unlock()
    finally:
        os.kill(runner.pid, signal.SIGCONT)
    assert not running
    assert runner.wait(timeout=30) == 75


def test_on_lost_warn_lets_a_stopped_sqllockers_command_run_on(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """With --on-lost=warn the watchdog does not act on the deadline either (documented: the
    command may then run beside the next holder)."""
    pids = tmp_path / "pids"
    runner = run_job(url, table_name, "--expires 3 --on-lost warn", f"echo $$ >> {pids}; sleep 60")
    (command,) = pids_in(pids, 1)
    reap_leftovers.append(command)
    stop_outside_a_write(runner.pid, url)
    try:
        second = migrated.lock("job", wait=30)
        assert alive(command)
        second.unlock()
    finally:
        os.kill(runner.pid, signal.SIGCONT)
        os.kill(command, signal.SIGTERM)
    runner.wait(timeout=30)
    assert runner.returncode == 75


def test_a_command_that_forks_many_times_is_stopped_whole(
    migrated: Locker,
    url: str,
    table_name: str,
    sqllocker: Run,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """A command that keeps forking children that ignore SIGTERM, half of them leaving the
    session, and never waits for them (zombies): stopped all the same, nothing of it left."""
    pids = tmp_path / "pids"
    forker = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "while True:\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"
        "        if os.getpid() % 2:\n"
        "            os.setsid()\n"
        "        time.sleep(0.05 if os.getpid() % 3 else 60)\n"
        "        os._exit(0)\n"
        f"    with open({str(pids)!r}, 'a') as out:\n"
        "        out.write(f'{child}\\n')\n"
        "    time.sleep(0.01)\n"
    )
    runner = popen(
        url,
        table_name,
        "run",
        "--expires",
        "3",
        "--kill-after",
        "1",
        "job",
        "--",
        sys.executable,
        "-c",
        forker,
    )
    pids_in(pids, 30)
    assert sqllocker("release", "job", "--force").returncode == 0
    runner.wait(timeout=30)
    assert runner.returncode == 75
    forked = [int(pid) for pid in pids.read_text().split()]
    reap_leftovers.extend(forked)
    wait_until(lambda: not any(alive(pid) for pid in forked), timeout=5)


def test_the_watchdog_is_a_subreaper_and_reaps(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
) -> None:
    """An orphan of the command is the watchdog's child (not init's), and reaped by it."""
    pids = tmp_path / "pids"
    runner = run_job(url, table_name, "", f"( sleep 1 & echo $! >> {pids} ); sleep 3")
    (orphan,) = pids_in(pids, 1)

    def parents_command() -> bytes:
        stat = Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()
        return Path(f"/proc/{stat[1]}/cmdline").read_bytes()

    # Once the subshell that started it has exited: until then, and for a moment as it exits
    # (its command line already gone), the orphan's parent is the subshell.
    wait_until(lambda: b"watchdog.py" in parents_command(), timeout=0.8)
    wait_until(lambda: not Path(f"/proc/{orphan}").exists(), timeout=10)  # reaped, no zombie
    assert runner.wait(30) == 0


def watchdog_of(runner: int) -> int:
    """The pid of the watchdog that sqllocker ``runner`` started."""
    for task in Path(f"/proc/{runner}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"watchdog.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError("no watchdog")


def test_a_killed_watchdogs_family_is_killed_but_not_what_sqllocker_was_given(
    migrated: Locker, url: str, table_name: str, tmp_path: Path, reap_leftovers: list[int]
) -> None:
    """sqllocker exec'd by a shell that had started another job, whose child it then is: when
    the watchdog dies and sqllocker kills every descendant of its own, that job is not of the
    command's family, and was killed with it."""
    background, shell = tmp_path / "background", tmp_path / "shell"
    inner = f"echo $$ > {shell}; sleep 60"
    script = (
        f"sleep 300 >/dev/null 2>&1 & echo $! > {background}; "
        f"exec {SQLLOCKER} --url {url} --table {table_name} run job -- sh -c '{inner}'"
    )
    runner = subprocess.Popen(["sh", "-c", script], stderr=subprocess.PIPE, text=True)
    (other,) = pids_in(background, 1)
    reap_leftovers.append(other)
    (command,) = pids_in(shell, 1)
    reap_leftovers.append(command)
    os.kill(watchdog_of(runner.pid), signal.SIGKILL)
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 75, err
    assert not alive(command)
    assert alive(other), "killed a process that was not the command's"


@pytest.mark.parametrize("signame", ["USR1", "USR2", "ALRM"])
def test_a_command_that_signals_its_own_group_does_not_kill_its_watchdog(
    migrated: Locker, url: str, table_name: str, signame: str
) -> None:
    """``kill -USR1 0`` from the command reaches its whole group, the watchdog (its leader)
    included, which died of it: the job was killed and exited 75 with the lock never lost."""
    script = f'trap "echo got it" {signame}; kill -{signame} 0; sleep 0.3; echo finished'
    runner = run_job(url, table_name, "", script)
    out, err = runner.communicate(timeout=30)
    assert runner.returncode == 0, err
    assert out.split() == ["got", "it", "finished"], out


def test_a_run_under_nohup_and_its_command_outlive_a_sighup(
    migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    """``nohup sqllocker run ...`` (sqllocker started with SIGHUP ignored), then the HUP that
    an ssh session's end sends: it was passed on to the command, set back to its default
    there, and the job died of it (129), where a plain ``nohup JOB`` lives on."""
    shell = tmp_path / "shell"
    script = f"echo $$ > {shell}; sleep 1; echo finished"
    sqllocker = [SQLLOCKER, "--url", url, "--table", table_name]
    runner = subprocess.Popen(
        ["nohup", *sqllocker, "run", "job", "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    (command,) = pids_in(shell, 1)
    os.kill(runner.pid, signal.SIGHUP)
    os.kill(command, signal.SIGHUP)
    out, err = runner.communicate(timeout=30)
    assert runner.returncode == 0, err
    assert out.split() == ["finished"]


def test_a_killed_watchdog_takes_the_family_with_it(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """The OOM killer picks the watchdog: sqllocker must not take the command for ended and
    release the lock while it runs; it kills the family (its orphans come to sqllocker)."""
    pids, beats = tmp_path / "pids", tmp_path / "beats"
    runner = run_job(
        url, table_name, "--expires 3", f"( {daemon(pids, beats)} & ); echo $$ >> {pids}; sleep 60"
    )
    family = pids_in(pids, 2)
    reap_leftovers.extend(family)
    watchdog = watchdog_of(runner.pid)
    os.kill(watchdog, signal.SIGKILL)
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 75, err
    assert "watchdog ended" in err
    assert [pid for pid in family if alive(pid)] == []
    assert migrated.lock_info("job") is None


def test_a_watchdog_killed_while_it_stops_what_the_command_left_has_it_killed_first(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """The command has exited and left a daemon that ignores SIGTERM; the watchdog has sent it
    SIGTERM and waits ``--kill-after`` before SIGKILL, and is killed meanwhile (a second
    holder before: sqllocker took the command's exit for the end, released the lock, and the
    daemon, now init's, ran on beside the next holder)."""
    pids, beats, shell = tmp_path / "pids", tmp_path / "beats", tmp_path / "shell"
    script = f"( {daemon(pids, beats)} & ); echo $$ > {shell}; sleep 0.5"
    runner = run_job(url, table_name, "--kill-after 30", script)
    (stubborn,) = pids_in(pids, 1)
    reap_leftovers.append(stubborn)
    (command,) = pids_in(shell, 1)
    wait_until(lambda: not alive(command))
    watchdog = watchdog_of(runner.pid)
    time.sleep(0.5)  # the command reaped, the daemon sent SIGTERM: --kill-after runs
    os.kill(watchdog, signal.SIGKILL)
    _, err = runner.communicate(timeout=30)
    released = time.monotonic()
    assert runner.returncode == 75, err
    assert "watchdog ended before what the command left running" in err
    assert not alive(stubborn)
    assert float(beats.read_text().split()[-1]) < released
    assert migrated.lock_info("job") is None


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# A stand-in for the watchdog descheduled, stopped or killed between starting the command and
# saying so: in the watchdog alone, posix_spawnp() stops the caller once the command is spawned.
STOP_AFTER_SPAWN = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <unistd.h>

static int in_the_watchdog(void) {
    char buf[4096];
    int fd = open("/proc/self/cmdline", O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    for (ssize_t i = 0; i < n; i++) if (!buf[i]) buf[i] = ' ';
    buf[n] = 0;
    return strstr(buf, "watchdog.py") != NULL;
}

int posix_spawnp(pid_t *pid, const char *file, const posix_spawn_file_actions_t *actions,
                 const posix_spawnattr_t *attr, char *const argv[], char *const envp[]) {
    int (*spawn)(pid_t *, const char *, const posix_spawn_file_actions_t *,
                 const posix_spawnattr_t *, char *const[], char *const[]) =
        dlsym(RTLD_NEXT, "posix_spawnp");
    int done = spawn(pid, file, actions, attr, argv, envp);
    if (done == 0 && in_the_watchdog()) raise(SIGSTOP);
    return done;
}
"""


@pytest.fixture
def stop_after_spawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Watchdogs started from now on stop (SIGSTOP) once they have started the command, before
    they say so (STOP_AFTER_SPAWN, built with gcc and preloaded)."""
    source, shim = tmp_path / "stop_after_spawn.c", tmp_path / "stop_after_spawn.so"
    source.write_text(STOP_AFTER_SPAWN)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"], check=True, timeout=60
    )
    monkeypatch.setenv("LD_PRELOAD", str(shim))


def _held_up_before_started(
    url: str, table_name: str, options: str, tmp_path: Path
) -> tuple[subprocess.Popen[str], int, int]:
    """A run whose watchdog ``stop_after_spawn`` stopped once it started the command: the run,
    the command's pid and the watchdog's."""
    pids = tmp_path / "pids"
    runner = run_job(url, table_name, options, f"echo $$ >> {pids}; sleep 60")
    (command,) = pids_in(pids, 1)
    watchdog = watchdog_of(runner.pid)
    wait_until(lambda: _state(watchdog) == "T")
    return runner, command, watchdog


def test_a_watchdog_killed_before_it_said_it_started_the_command_has_the_command_killed(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
    stop_after_spawn: None,
) -> None:
    """The watchdog killed once it has started the command and before it has said so: the
    command runs (a second holder before: sqllocker read no word, took the command for never
    started, exited 126 and released the lock)."""
    runner, command, watchdog = _held_up_before_started(url, table_name, "", tmp_path)
    reap_leftovers.append(command)
    os.kill(watchdog, signal.SIGKILL)
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 75, err
    assert "whether the command started" in err
    assert not alive(command)
    assert migrated.lock_info("job") is None


def test_a_lock_lost_while_the_watchdog_has_not_said_it_started_stops_the_command(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
    stop_after_spawn: None,
) -> None:
    """The watchdog stopped between starting the command and saying so (descheduled, or a
    SIGSTOP), and the lock broken meanwhile: sqllocker, still waiting for its word, had no
    family to stop, and the command ran on without the lock, beside the next holder."""
    runner, command, _ = _held_up_before_started(url, table_name, "--expires 3", tmp_path)
    reap_leftovers.append(command)
    assert migrated.break_lock("job") is not None
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 75, err
    assert not alive(command)


def test_a_pid_used_again_is_not_signalled() -> None:
    """The watchdog signals a process only if it is still the one it found (same start time):
    a pid that has passed to another process meanwhile is left alone."""
    from sqllocker.watchdog import Family, _stat

    bystander = subprocess.Popen(["sleep", "30"])
    try:
        info = _stat(bystander.pid)
        assert info is not None
        Family(subreaper=True).signal(signal.SIGKILL, {(bystander.pid, info[1] - 1)})
        time.sleep(0.2)
        assert bystander.poll() is None
        Family(subreaper=True).signal(signal.SIGKILL, {(bystander.pid, info[1])})
        assert bystander.wait(10) == -signal.SIGKILL
    finally:
        bystander.kill()
        bystander.wait()


def test_a_family_that_ends_at_the_sigterm_is_not_kept_waiting_for_the_sigkill(
    migrated: Locker, url: str, table_name: str, sqllocker: Run, tmp_path: Path
) -> None:
    """The watchdog watches the family while --kill-after runs: once all of it has ended on
    the SIGTERM, sqllocker exits, without waiting out the 60 s."""
    pids = tmp_path / "pids"
    runner = run_job(
        url, table_name, "--expires 3 --kill-after 60", f"sleep 60 & echo $! >> {pids}; wait"
    )
    pids_in(pids, 1)
    started = time.monotonic()
    assert sqllocker("release", "job", "--force").returncode == 0
    assert runner.wait(timeout=60) == 75
    assert time.monotonic() - started < 30


# Says it got SIGTERM (in argv[1]) and exits; while stopped (SIGSTOP) it can say nothing.
SAYS_TERM = """
import signal, sys, time
def said(signum, frame):
    open(sys.argv[1], "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, said)
time.sleep(60)
"""


def test_a_stopped_process_of_the_family_is_woken_to_act_on_the_sigterm(
    migrated: Locker,
    url: str,
    table_name: str,
    sqllocker: Run,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """A process of the family that is stopped (SIGSTOP, Ctrl-Z) would hold the SIGTERM
    pending until the SIGKILL: it is sent SIGCONT with it, and ends on its own terms."""
    pids, said = tmp_path / "pids", tmp_path / "got-term"
    runner = run_job(
        url,
        table_name,
        "--expires 3 --kill-after 60",
        f"{sys.executable} -c '{SAYS_TERM}' {said} & echo $! >> {pids}; wait",
    )
    (stopped,) = pids_in(pids, 1)
    reap_leftovers.append(stopped)
    time.sleep(0.5)  # its handler is in place
    os.kill(stopped, signal.SIGSTOP)
    assert sqllocker("release", "job", "--force").returncode == 0
    assert runner.wait(timeout=60) == 75
    assert said.exists()


# A process whose main thread ends (pthread_exit) while another thread works on: /proc shows
# it as a zombie ("Z"), though it runs. Writes its pid to argv[1], then beats to argv[2].
HEADLESS = """
import ctypes, os, sys, threading, time
def beat():
    while True:
        with open(sys.argv[2], "a") as out:
            out.write(f"{time.monotonic()}\\n")
        time.sleep(0.02)
with open(sys.argv[1], "a") as out:
    out.write(f"{os.getpid()}\\n")
threading.Thread(target=beat).start()
time.sleep(0.1)
ctypes.CDLL(None).pthread_exit(None)
"""

# A daemon that never stays put: each generation forks the next and exits at once, faster than
# anyone can list /proc; every so often one writes a beat to argv[1], and its process group to
# argv[2] (so that a failed test can kill what is left).
FORK_CHAIN = """
import os, sys, time
with open(sys.argv[2], "w") as out:
    out.write(f"{os.getpgrp()}\\n")
count = 0
while True:
    count += 1
    if count % 50 == 0:
        with open(sys.argv[1], "a") as out:
            out.write(f"{time.monotonic()}\\n")
    if os.fork():
        os._exit(0)
"""


def test_a_process_whose_main_thread_ended_is_stopped_before_the_lock_is_released(
    migrated: Locker,
    url: str,
    table_name: str,
    tmp_path: Path,
    reap_leftovers: list[int],
) -> None:
    """A zombie in /proc is not always done: its other threads may run on. The watchdog took
    it for ended, and sqllocker released the lock while it worked."""
    pids, beats = tmp_path / "pids", tmp_path / "beats"
    runner = run_job(
        url,
        table_name,
        "--kill-after 1",
        f"{sys.executable} -c '{HEADLESS}' {pids} {beats} >/dev/null 2>&1 & sleep 0.5",
    )
    (headless,) = pids_in(pids, 1)
    reap_leftovers.append(headless)
    try:
        _, err = runner.communicate(timeout=30)
        assert runner.returncode == 0, err
        released = time.monotonic()
        assert migrated.lock_info("job") is None
        time.sleep(0.2)
        assert float(beats.read_text().split()[-1]) < released
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(headless, signal.SIGKILL)


@pytest.mark.parametrize("how", ["left running", "lock broken"])
def test_a_daemon_that_forks_faster_than_proc_is_read_is_stopped_all_the_same(
    migrated: Locker,
    url: str,
    table_name: str,
    sqllocker: Run,
    tmp_path: Path,
    how: str,
) -> None:
    """Every generation of the daemon had ended (a zombie) by the time the watchdog read it,
    and the next one was not yet listed: the family looked gone, and sqllocker released the
    lock while the daemon ran on."""
    beats, group = tmp_path / "beats", tmp_path / "group"
    runner = run_job(
        url,
        table_name,
        "--expires 3 --kill-after 1",
        f"{sys.executable} -c '{FORK_CHAIN}' {beats} {group} >/dev/null 2>&1 & sleep 1"
        + ("" if how == "left running" else "; sleep 60"),
    )
    try:
        wait_until(lambda: beats.exists() and group.exists())
        if how == "lock broken":
            assert sqllocker("release", "job", "--force").returncode == 0
        _, err = runner.communicate(timeout=60)
        assert runner.returncode == (0 if how == "left running" else 75), err
        ended = time.monotonic()
        time.sleep(0.5)
        assert float(beats.read_text().split()[-1]) < ended
    finally:
        runner.kill()
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(group.read_text()), signal.SIGKILL)


# ``sqllocker run ARGS`` that freezes itself (SIGSTOP: every thread, the keep-alive's too) at
# POINT between its acquire and its command's start, until the file GO exists: a run stalled
# there (a VM paused, a debugger, its database frozen) for longer than its lock's expiry.
STALLED_RUN = """
import os, signal, sys, time
go, point, args = sys.argv[1], sys.argv[2], sys.argv[3:]
import sqllocker.rwlock, sqllocker.watchdog
from sqllocker.cli import main
owner, name = {
    "before its keep-alive": (sqllocker.rwlock.WriteLock, "keep_alive"),
    "before its watchdog starts": (sqllocker.watchdog, "become_subreaper"),
}[point]
original = getattr(owner, name)
def stalled(*arguments, **options):
    while not os.path.exists(go):
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.05)  # woken early (see the test): a renewal's write ends meanwhile
    return original(*arguments, **options)
setattr(owner, name, stalled)
sys.argv = ["sqllocker", *args]
sys.exit(main())
"""


def stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("point", ["before its keep-alive", "before its watchdog starts"])
def test_a_run_stalled_past_its_deadline_before_its_command_starts_never_starts_it(
    migrated: Locker, url: str, table_name: str, tmp_path: Path, point: str
) -> None:
    """A run stalled between its acquire and its command's start until its lock's row expired
    and another took the lock must not start the command when it goes on: sqllocker checks the
    lock last before it starts the watchdog, and the watchdog last before it starts the
    command; the run exits 75 and the other holder's lock is untouched."""
    go, started = tmp_path / "go", tmp_path / "started"
    run = ["--url", url, "--table", table_name, "run", "--expires", "2", "job", "--"]
    runner = subprocess.Popen(
        [sys.executable, "-c", STALLED_RUN, str(go), point, *run, "sh", "-c", f"> {started}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: stopped(runner.pid))
        if url.startswith("sqlite"):  # not inside a renewal's write, holding SQLite's write lock
            stop_outside_a_write(runner.pid, url)
        second = take_over_at_expiry(migrated, "job")
        go.touch()
    finally:
        os.kill(runner.pid, signal.SIGCONT)
    _, err = runner.communicate(timeout=30)
    assert not started.exists(), "the command ran beside the next holder"
    assert runner.returncode == 75, err
    assert "ran out or was lost before the command could start: it was not started" in err
    second.unlock()  # still ours: the stalled run did not touch it


def test_a_broken_lock_stops_the_command_though_stderr_cannot_be_written(tmp_path: Path) -> None:
    """A renewal that finds the lock broken stops the family at once, before anything is
    written to stderr: with a stderr that fails (``/dev/full``), the stop waited for the lock's
    deadline, and the run exited 1 instead of 75."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    beats = tmp_path / "beats"
    locker = Locker(url, grace=0)
    locker.create_table()
    beating = f"while :; do date +%s >> {beats}; sleep 0.1; done"
    with open("/dev/full", "w") as full:
        runner = subprocess.Popen(
            [SQLLOCKER, "--url", url, "run", "--expires", "12", "job", "--", "sh", "-c", beating],
            stderr=full,
        )
    try:
        wait_until(lambda: beats.exists())
        started = time.monotonic()  # the command runs: the lock was taken a moment before
        assert locker.break_lock("job") is not None
        assert runner.wait(timeout=60) == 75
        lasted = time.monotonic() - started
    finally:
        if runner.poll() is None:
            runner.kill()
        locker.close()
    # Renewed every 4 s, the lock is found broken at most 4 s after the command started; its
    # deadline is 10.8 s after its acquire (a start on a busy machine counted no more).
    assert lasted < 9, f"the command ran {lasted:.1f} s: until the deadline, not the renewal"


@pytest.mark.parametrize("backend", ["sqlite"])  # the run's own, the same on every backend
@pytest.mark.parametrize("closed", ["<&-", ">&-", "2>&-"], ids=["stdin", "stdout", "stderr"])
def test_a_run_started_with_a_stream_closed_holds_the_lock_until_its_command_ends(
    migrated: Locker, url: str, table_name: str, tmp_path: Path, closed: str
) -> None:
    """``sqllocker run`` started with its stdin closed (``<&-``, a supervisor's way): it failed
    after starting the command (``sys.stdin`` is None), printed a traceback and released the
    lock while the command ran on; one that ignored SIGTERM ran beside the next holder until
    the watchdog's SIGKILL, 10 s later. With stdout or stderr closed, a run is a run too."""
    log = tmp_path / "log"
    job = f"trap '' TERM; echo start >> {log}; sleep 2; echo end >> {log}"
    sqllocker = [SQLLOCKER, "--url", url, "--table", table_name, "run"]
    first = subprocess.Popen(
        ["bash", "-c", f'exec "$@" {closed}', "-", *sqllocker, "job", "--", "sh", "-c", job],
        stderr=subprocess.PIPE if closed != "2>&-" else None,
        text=True,
    )
    wait_until(lambda: log.exists() and "start" in log.read_text())
    second = subprocess.run(
        [*sqllocker, "-w", "30", "job", "--", "sh", "-c", f"echo second >> {log}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert not err, err  # no traceback
    assert second.returncode == 0, second.stderr
    assert log.read_text().split() == ["start", "end", "second"]


@pytest.mark.parametrize("backend", ["sqlite"])  # the run's own, the same on every backend
def test_a_run_whose_stderr_is_full_still_stops_its_family_and_releases_the_lock(
    migrated: Locker, url: str, table_name: str, tmp_path: Path, reap_leftovers: list[int]
) -> None:
    """sqllocker's stderr a pipe nobody reads, full: its line "stopping what the command left
    running" blocked the run's main thread before it released the lock, which its keep-alive
    renewed for ever (a second run waited in vain). Its lines are written by a thread of their
    own now: the leftover is stopped, the lock released, and the next run gets it."""
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(writer, b"x" * 65536)
    os.set_blocking(writer, True)
    pids = tmp_path / "pids"
    job = f"sleep 60 & echo $! > {pids}"  # left running: stopped before the release, and said
    sqllocker = [SQLLOCKER, "--url", url, "--table", table_name, "run"]
    try:
        first = subprocess.Popen([*sqllocker, "job", "--", "sh", "-c", job], stderr=writer)
        reap_leftovers.extend(pids_in(pids, 1))
        second = subprocess.run(
            [*sqllocker, "-w", "20", "job", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert second.returncode == 0, second.stderr  # the first released it
        assert first.wait(timeout=30) == 0
    finally:
        os.close(writer)
        os.close(reader)

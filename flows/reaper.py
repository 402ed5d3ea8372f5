"""Nothing a `ragen` command starts outlives it, however it ends (a normal end, Ctrl-C, SIGTERM, SIGKILL).

A command starts child processes it does not always control: Prefect's temporary API server (ephemeral
mode), the ranks of a multi-process run, sweep workers, vLLM's engine processes, the compiler of the CPU
decode kernel. A normal end stops them; a signal that kills the command does not (SIGKILL runs no handler,
and SIGTERM's default action skips ``atexit``), and they would run on, adopted by init.

So :func:`start` marks the command's environment with a token that every process it starts inherits
(``RAGEN_PROCESS_TOKENS``, a colon-separated list: a `ragen` started by a `ragen` adds its own), and starts a
reaper: a small process in a session of its own that ignores the terminal's and a scheduler's polite signals,
waits for the command to end, then ends every process that carries the token (SIGTERM, then SIGKILL after
``GRACE_S``) and exits. A process that cleared its environment would escape; none of ours does.

Run by the CLI (flows/cli.py) for the commands that start processes; tests: tests/flows/test_chaos.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil

TOKENS = "RAGEN_PROCESS_TOKENS"
GRACE_S = 5.0
"""How long a marked process gets to stop after SIGTERM before it is killed."""
POLL_S = 0.2


def start() -> str:
    """Mark this process's environment (inherited by everything it starts) and start its reaper; the token."""
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.environ[TOKENS] = ":".join([*filter(None, os.environ.get(TOKENS, "").split(":")), token])
    subprocess.Popen([sys.executable, "-m", "flows.reaper", str(os.getpid()), token], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, start_new_session=True)
    return token


def marked(token: str) -> list[psutil.Process]:
    """The live processes (zombies aside) whose environment carries ``token``, this one excepted."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE \
                    and token in proc.environ().get(TOKENS, "").split(":"):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def end_marked(token: str) -> int:
    """SIGTERM every process carrying ``token``, SIGKILL those alive after GRACE_S; again while new ones show
    up (a process may start another while being stopped). Returns how many there were."""
    ended = 0
    for _ in range(5):
        procs = marked(token)
        if not procs:
            break
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=GRACE_S)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=GRACE_S)
        ended += len(procs)
    return ended


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def main(pid: int, token: str) -> None:
    """The reaper: wait for process ``pid`` to end (a zombie has ended), then end what carries ``token``."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while not _ended(pid):
        time.sleep(POLL_S)
    ended = end_marked(token)
    if ended:
        print(f"ragen: stopped {ended} process(es) left running by pid {pid}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])

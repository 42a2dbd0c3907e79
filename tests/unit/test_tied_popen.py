"""`testkit.tied_popen`: a child started by a test process dies with it, even when it is SIGKILLed.

The servers the tests start (the Kubernetes fixture's etcd and kube-apiserver) outlived a run killed
by a signal. A stand-in test process starts two children, one from its main thread and one from a
thread that then ends (as `asyncio.to_thread` does); the second must survive its thread, and both
must die with the process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from testkit import alive, survivors

TESTS = Path(__file__).resolve().parents[1]

STAND_IN = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    from testkit import tied_popen

    def child():
        # Echoes one line (proof it is alive), then sleeps: it never ends on its own, and not on EOF.
        return tied_popen(["sh", "-c", 'read line; echo "$line"; exec sleep 600'],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    children = [child()]
    worker = threading.Thread(target=lambda: children.append(child()))
    worker.start()
    worker.join()
    while os.path.exists(f"/proc/self/task/{worker.native_id}"):
        time.sleep(0.01)  # the OS thread is gone: a death signal tied to it has been sent
    for proc in children:
        proc.stdin.write(b"alive\\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"alive\\n", "a child died before the process"
    print(*(proc.pid for proc in children), flush=True)
    time.sleep(600)
""")


def test_children_outlive_the_thread_that_started_them_and_die_with_the_process() -> None:
    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(TESTS)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    try:
        assert stand_in.stdout is not None and stand_in.stderr is not None
        line = stand_in.stdout.readline()
        assert line, f"the stand-in printed no pids: {stand_in.stderr.read().decode(errors='replace')}"
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
    finally:
        stand_in.send_signal(signal.SIGKILL)
        stand_in.wait()
        stand_in.stdout.close()  # type: ignore[union-attr]
        stand_in.stderr.close()  # type: ignore[union-attr]
    assert survivors(pids, timeout=10) == [], "children outlived the SIGKILLed test process"

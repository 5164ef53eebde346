"""Ends a vLLM server's whole process group when the process that started it ends: run by path beside each server.

A server's guard: a tiny process that outlives its starter. When the starter ends (its parent id changes), it
ends the server's whole process group (the API server and vLLM's engine processes): SIGTERM, then SIGKILL after
10 s. When the server ends first, so does the guard. (PR_SET_PDEATHSIG would follow the starting *thread*, and
reach only the API server.)

Standard library only: it starts in a bare environment (PATH alone), with neither torch nor vLLM to wait on.
Arguments: the starter's pid, and the server's pid, which names its process group (it runs in a session of its own).
"""
import os
import signal
import sys
import time

parent, group = int(sys.argv[1]), int(sys.argv[2])


def alive():
    try:
        os.killpg(group, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


while os.getppid() == parent and alive():
    time.sleep(0.5)
for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0)):
    if not alive():
        break
    os.killpg(group, sig)
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)

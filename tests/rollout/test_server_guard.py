"""The vLLM server's guard (tandem/rollout/vllm/server_guard.py): a starter killed outright takes its server with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A starter as VLLMServerEngine is one, with `sleep` for the server (the guard ends whatever runs in its group).
STARTER = """
import sys
from tandem.rollout.vllm.server import VLLMServerEngine
engine = object.__new__(VLLMServerEngine)
engine.log_path = None
engine._spawn(["sleep", "600"], None)
print(engine.proc.pid, flush=True)
sys.stdin.read()
"""


def _group_ended(group: int) -> bool:
    """No process of `group` is left running (one not reaped yet, a zombie, has ended)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    try:
        return open(f"/proc/{group}/stat").read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_a_server_whose_starter_is_killed_outright_is_ended_by_its_guard():
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    server = int(starter.stdout.readline())
    try:
        assert not _group_ended(server)
        starter.kill()  # SIGKILL: nothing of the starter's own runs after it
        starter.wait()
        deadline = time.monotonic() + 20
        while not _group_ended(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group_ended(server), "the server outlived its starter: its guard did not end it"
    finally:
        if not _group_ended(server):
            os.killpg(server, signal.SIGKILL)

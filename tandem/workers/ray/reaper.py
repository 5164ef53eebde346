"""Ends the raylet's agents when the controller that started tandem's own Ray dies without shutting it down.

A controller killed outright (SIGKILL, the OOM killer) takes the Ray it started with it: its head processes are
fate-shared with it by the kernel. But the raylet's two agents (the dashboard agent and the runtime-env agent) are
the raylet's children: they see it die, find no "SIGTERM" in its log, and report an unexpected death to the GCS,
which died too, through a call whose 60 s timeout Ray hard-codes (ray._private.utils.publish_error_to_driver); they
hold their loopback ports meanwhile. Ray has no option that leaves them out (include_dashboard=False, which tandem
passes, stops only the dashboard's web server; actors' runtime_env needs the runtime-env agent).

So tandem.workers.ray.session starts this script (standard library only, run by path) beside its own Ray. It notes the
raylet's children (the controller's child named `raylet`) every 2 s, and at an end-of-file on its stdin with nothing
written (the controller is gone without shutting Ray down) kills those still alive (the same pid and start time).
Their environment cannot tell them: Ray's process titles overwrite it. A controller that shuts Ray down writes to the
pipe first: the reaper then exits and kills nothing.
"""
import os
import select
import signal
import sys

NOTE_EVERY_S = 2.0


def stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, name) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/comm") as f:
            return int(fields[1]), fields[19], f.read().strip()
    except (OSError, IndexError, ValueError):
        return None


def main() -> None:
    controller = os.getppid()
    seen: dict[int, str] = {}  # pid -> start time: the raylet and its children
    while True:
        procs = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := stat(int(p))) is not None}
        raylets = {p for p, s in procs.items() if s[0] == controller and s[2] == "raylet"}
        seen.update({p: s[1] for p, s in procs.items() if p in raylets or s[0] in raylets})
        if select.select([sys.stdin], [], [], NOTE_EVERY_S)[0]:
            if os.read(0, 64):
                return  # Ray was shut down in order
            break  # end of file: the controller is gone
    for pid, start in seen.items():
        s = stat(pid)
        if s is not None and s[1] == start:  # the same process, not a new one that took its pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main()

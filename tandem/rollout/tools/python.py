"""The "python" tool: the call run as a program in the code sandbox (tandem.sandbox), its stdout the answer."""
from __future__ import annotations

import signal
from typing import Sequence

from tandem.rollout.tools.base import Tool, ToolResult, register_tool
from tandem.sandbox import BOOT, SandboxLimits, check_sandbox, run_python


class PythonTool:
    """The "python" tool (tag `python`): runs the call as a program in the code sandbox (tandem.sandbox) and
    returns its stdout; "timeout" when it ran out of wall or CPU time, "crashed" (text: the last lines of stderr)
    when it exited nonzero. The sandbox is checked when the tool is built, as the `code` reward's preflight does: a
    sandbox that fails its self-test, or a weak one (no namespaces) unless `allow_weak_sandbox`, is refused."""

    tag = "python"
    bounded = True  # the sandbox enforces wall time and kills everything the program started
    stderr_lines = 10
    stderr_chars = 1000

    def __init__(self, cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 1024, output_bytes: int = 64 << 10,
                 packages: Sequence[str] = (), allow_weak_sandbox: bool = False):
        check_sandbox(tuple(packages), allow_weak_sandbox)
        self.limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, output_bytes=output_bytes)
        self.packages = tuple(packages)

    def __call__(self, call: str) -> ToolResult:
        r = run_python(call, "", self.limits, packages=self.packages)
        # The CPU limit ends a busy loop before the wall limit does: SIGXCPU at the soft limit, SIGKILL at the hard.
        if r.timed_out or r.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return ToolResult(f"error: timed out (limits: {self.limits.cpu_s} s CPU, {self.limits.wall_s:g} s wall)",
                              "timeout")
        # The file-size limit caps the output: a program that reaches it dies of SIGXFSZ or EFBIG (OSError).
        if r.returncode != 0 and len(r.stdout.encode()) >= self.limits.output_bytes:
            return ToolResult(r.stdout, "too_long")
        if r.returncode != 0:
            # The sandbox's own frames name host paths and mean nothing to the model: only the program's remain.
            lines = [ln for ln in r.stderr.rstrip().splitlines() if BOOT not in ln]
            tail = "\n".join(lines[-self.stderr_lines:])[-self.stderr_chars:]
            return ToolResult(tail or f"error: exit code {r.returncode}", "crashed")
        return ToolResult(r.stdout)


@register_tool("python")
def python_tool(cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 1024, output_bytes: int = 64 << 10,
           packages: Sequence[str] = (), allow_weak_sandbox: bool = False) -> Tool:
    return PythonTool(cpu_s, wall_s, memory_mb, output_bytes, packages, allow_weak_sandbox)

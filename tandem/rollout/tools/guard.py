"""Calling any tool so that it cannot stop the run: its exceptions caught, its time bounded by a watchdog thread."""
from __future__ import annotations

import threading

from tandem.rollout.tools.base import ERRORS, Tool, ToolResult


class GuardedTool:
    """Calls a tool so that it cannot stop the run: an exception is error "crashed"; a tool that does not declare
    itself `bounded` runs in a daemon thread and reports "timeout" after `timeout_s`. A thread cannot be killed, so a
    hung call is left running; while `max_hung` calls of this tool are still hung, new calls are not started."""

    def __init__(self, tool: Tool, name: str, timeout_s: float = 10.0, max_hung: int = 4):
        self.tool, self.name, self.timeout_s, self.max_hung = tool, name, timeout_s, max_hung
        self.bounded = bool(getattr(tool, "bounded", False))
        self._hung: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __call__(self, call: str) -> ToolResult:
        if self.bounded:
            return self._checked(call)
        with self._lock:
            self._hung = [t for t in self._hung if t.is_alive()]
            if len(self._hung) >= self.max_hung:
                return ToolResult(f"error: timed out ({len(self._hung)} earlier calls still running)", "timeout")
        box: list[ToolResult] = []
        thread = threading.Thread(target=lambda: box.append(self._checked(call)), daemon=True,
                                  name=f"tool-{self.name}")
        thread.start()
        thread.join(self.timeout_s)
        if box:
            return box[0]
        with self._lock:
            self._hung.append(thread)
        return ToolResult(f"error: timed out after {self.timeout_s:g} s", "timeout")

    def _checked(self, call: str) -> ToolResult:
        try:
            result = self.tool(call)
        except (Exception, SystemExit):  # the run never stops for a tool (a Ctrl-C still stops it)
            return ToolResult("error: crashed", "crashed")
        if isinstance(result, str):  # a plain function returning text is a tool too
            return ToolResult(result)
        well_formed = isinstance(result, ToolResult) and isinstance(result.text, str)
        if not well_formed or result.error not in (None, *ERRORS):
            return ToolResult("error: crashed", "crashed")  # a wrong answer type is the tool's bug, not the model's
        return result

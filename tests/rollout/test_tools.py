"""Tools for multi-turn rollouts: the calculator's values and refusals, the tools environment's turn parsing, bounds on
every call (output size, exceptions, hangs, the python sandbox's time) and the registries' refusals."""
from __future__ import annotations

import threading
import time

import pytest

from tandem.rollout.tools import (ENVIRONMENTS, TOOLS, StepResult, ToolResult, calculate, make_environment,
                                  make_tool, register_environment, register_tool)

PLUGIN = __name__  # plugins below are given as f"{PLUGIN}:factory", as a user's module would be
_release = threading.Event()  # lets the hanging plugin's thread end when the tests are done


def megabyte():
    return lambda call: ToolResult("x" * (1 << 20))


def raises():
    def tool(call: str) -> ToolResult:
        raise RuntimeError("the plugin's own bug")

    return tool


def hangs():
    def tool(call: str) -> ToolResult:
        _release.wait(30)
        return ToolResult("late")

    return tool


def echo(prefix: str = ""):
    def tool(call: str) -> ToolResult:
        return ToolResult(prefix + call)

    tool.tag = "say"
    return tool


@pytest.fixture(autouse=True, scope="module")
def _release_hung_threads():
    yield
    _release.set()


@pytest.mark.parametrize("expr, out", [
    ("123*456", "56088"), (" 7 - 10 ", "-3"), ("(2+3)*-4", "-20"), ("7 // 2", "3"), ("7 % 3", "1"), ("2**10", "1024"),
    ("6/4", "1.5"), ("0.1+0.2", "0.30000000000000004"), ("2**-2", "0.25"), ("(10**64)**64", "1" + "0" * 4096)])
def test_calculator_values(expr, out):
    assert calculate(expr) == ToolResult(out)


@pytest.mark.parametrize("expr", [
    "2**10**10", "((10**64)**64)**64", "__import__('os').system('true')", "1/0", "5 % 0", "abs(-1)", "x", "'a'*3",
    "1 if 1 else 2", "[1]", "3 > 2", "1 +", "(-8)**0.5", "1e308*10", "True+1", "2 ^ 3", "-" * 1000 + "1",
    "1+" * 5000 + "1"])
def test_calculator_refuses_quickly(expr):
    t = time.monotonic()
    r = make_tool("calculator")(expr)
    assert r.error == "bad_call" and r.text.startswith("error: "), r
    assert time.monotonic() - t < 0.5


def test_a_call_at_the_end_of_the_turn_runs_the_tool():
    env = make_environment("tools", tools=["calculator"])
    assert env.stop == ("</calc>",) and env.reset("123*456=") == ""
    assert env.step("123*456=<calc>123*456</calc>") == StepResult("<result>56088</result>", None, False, "calculator")
    assert env.step("let me see <calc>2**10</calc> \n").observation == "<result>1024</result>"  # trailing whitespace
    assert env.step("<calc>1/0</calc>") == StepResult("<result>error: division by zero</result>", None, False,
                                                      "calculator", "bad_call")


@pytest.mark.parametrize("turn", ["56088", "<calc>1+1</calc> so the answer is 2", "no opening tag 1+1</calc>",
                                  "<search>cats</search>", "<python>print(1)</python>", ""])
def test_a_turn_without_a_call_ends_the_conversation(turn):
    env = make_environment("tools", tools=["calculator"])
    assert env.step(turn) == StepResult("", None, True)


def test_a_1_mb_output_is_cut_to_max_output_chars():
    env = make_environment("tools", tools=[f"{PLUGIN}:megabyte"], max_output_chars=100)
    r = env.step("<megabyte>go</megabyte>")
    assert r.error == "too_long" and r.tool == f"{PLUGIN}:megabyte" and not r.done
    assert r.observation.startswith("<result>xxx") and r.observation.endswith("(truncated)</result>")
    assert len(r.observation) == len("<result></result>") + 100


def test_a_tool_that_raises_is_crashed_and_the_run_goes_on():
    env = make_environment("tools", tools=["calculator", f"{PLUGIN}:raises"])
    assert env.stop == ("</calc>", "</raises>")
    assert env.step("<raises>x</raises>") == StepResult("<result>error: crashed</result>", None, False,
                                                        f"{PLUGIN}:raises", "crashed")
    assert env.step("<calc>1+1</calc>").observation == "<result>2</result>"


def test_a_tool_that_hangs_times_out_within_its_bound():
    env = make_environment("tools", tools=[f"{PLUGIN}:hangs"], tool_timeout_s=0.2)
    t = time.monotonic()
    r = env.step("<hangs>x</hangs>")
    assert r.error == "timeout" and r.observation.startswith("<result>error: timed out")
    assert time.monotonic() - t < 1.0
    for _ in range(4):  # hung threads pile up to a bound; after it, calls are refused at once
        env.step("<hangs>x</hangs>")
    t = time.monotonic()
    assert env.step("<hangs>x</hangs>").error == "timeout" and time.monotonic() - t < 0.1


def test_tool_kwargs_and_tags():
    env = make_environment("tools", tools=["calculator", f"{PLUGIN}:echo"], prefix="> ")  # echo's tag is `say`
    assert env.stop == ("</calc>", "</say>")
    assert env.step("<say>hi</say>").observation == "<result>> hi</result>"
    env = make_environment("tools", tools=[f"{PLUGIN}:echo"], **{f"{PLUGIN}:echo": {"prefix": "+"}})
    assert env.step("<say>hi</say>").observation == "<result>+hi</result>"
    with pytest.raises(TypeError, match="takes 'wall_s'"):
        make_environment("tools", tools=["calculator"], wall_s=2)
    with pytest.raises(ValueError, match="both use the tag <say>"):
        make_environment("tools", tools=[f"{PLUGIN}:echo", f"{PLUGIN}:echo2"])


def echo2():
    return echo()  # the same tag as echo's


def test_registries_refuse_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="registered twice"):
        register_tool("calculator")(lambda: None)
    with pytest.raises(ValueError, match="registered twice"):
        register_environment("tools")(lambda: None)
    assert "calculator" in TOOLS and "python" in TOOLS and "tools" in ENVIRONMENTS
    with pytest.raises(KeyError, match="did you mean 'calculator'"):
        make_tool("calculater")
    with pytest.raises(KeyError, match="did you mean 'tools'"):
        make_environment("tool")
    with pytest.raises(KeyError, match="did you mean 'python'"):
        make_environment("tools", tools=["pyhton"])
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        make_tool("no_such_module_xyz:f")
    with pytest.raises(TypeError, match="takes no kwarg 'wall_s'"):
        make_tool("calculator", wall_s=1)


@pytest.fixture(scope="module")
def python_env():
    from tandem.sandbox import SandboxBroken

    try:  # as the code reward's tests do, run where the sandbox is weak too: what is checked here is the tool
        return make_environment("tools", tools=["python"], cpu_s=1, wall_s=2.0, allow_weak_sandbox=True)
    except SandboxBroken as exc:
        pytest.skip(f"the code sandbox cannot run programs on this machine: {exc}")


def test_python_prints_a_value(python_env):
    assert python_env.stop == ("</python>",)
    r = python_env.step("Let me compute.\n<python>\nimport math\nprint(math.factorial(20))\n</python>")
    assert r == StepResult("<result>2432902008176640000\n</result>", None, False, "python")


def test_python_errors_are_reported(python_env):
    r = python_env.step("<python>1/0</python>")
    assert r.error == "crashed" and "ZeroDivisionError: division by zero" in r.observation
    assert "boot.py" not in r.observation  # only the program's own frames
    t = time.monotonic()
    r = python_env.step("<python>while True:\n    pass</python>")
    assert r.error == "timeout" and time.monotonic() - t < 4.0


def test_python_in_a_weak_sandbox_is_refused_unless_allowed(monkeypatch):
    from tandem import sandbox
    from tandem.sandbox import SandboxBroken

    monkeypatch.setattr(sandbox, "self_test", lambda packages=(): {"net": 0, "fs": 0, "uid": 0, "pid": 0})
    with pytest.raises(SandboxBroken, match="allow_weak_sandbox"):
        make_tool("python")


def test_a_tool_tag_can_be_renamed():
    env = make_environment("tools", tools=["calculator"], tags={"calculator": "tool"})
    assert env.stop == ("</tool>",)
    assert env.step("<tool>6*7</tool>").observation == "<result>42</result>"
    assert env.step("<calc>6*7</calc>").done  # the old tag is plain text now
    with pytest.raises(ValueError, match="name no tool"):
        make_environment("tools", tools=["calculator"], tags={"python": "py"})

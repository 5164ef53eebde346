"""Environments for multi-turn rollouts, and the tools they call: `base` (the contract, registries, building by name),
`calculator`, `python` (the code sandbox), `guard` (calling any tool so it cannot stop the run), `environment`
(the "tools" environment).

A multi-turn loop (tandem/rollout/multiturn.py) generates a turn until one of the environment's `stop` strings, hands
the turn's text to `Environment.step`, appends the observation it returns (tokenized once, loss mask 0) and goes on
until `done`. The built-in environment "tools" runs a tool when a turn ends with `<TAG>call</TAG>` and answers
`<result>OUTPUT</result>`:

    env = make_environment("tools", tools=["calculator"])   # env.stop == ("</calc>",)
    env.step("123*456=<calc>123*456</calc>")                 # StepResult("<result>56088</result>", None, False, ...)
    env.step("56088")                                        # no call: done

Every call is bounded in time, and a tool never stops the run: the calculator by its bounds on exponents and digits,
python by its sandbox's limits, and any other tool (plugins) by a worker thread with `tool_timeout_s`, after which
the call reports "timeout" (the thread cannot be killed: it is left to finish as a daemon, and a tool with too many
calls still hung is not called again until one returns). A tool that declares itself bounded (`tool.bounded = True`,
as the built-ins do) is called directly. Exceptions from any tool are reported as error "crashed".

Plugins are given as "module:function" where a name is expected: a tool factory for `make_tool` (and in the tools
environment's `tools` list), an environment factory for `make_environment`. A tool's tag is its `tag` attribute, else
its registered name (or the plugin's function name).
"""
from tandem.rollout.tools.base import (  # noqa: F401
    ENVIRONMENTS,
    ERRORS,
    TOOLS,
    Environment,
    StepResult,
    Tool,
    ToolResult,
    make_environment,
    make_tool,
    register_environment,
    register_tool,
)
from tandem.rollout.tools.calculator import Calculator, calculate  # noqa: F401  (registers "calculator")
from tandem.rollout.tools.environment import ToolsEnvironment, tools_environment  # noqa: F401  (registers "tools")
from tandem.rollout.tools.guard import GuardedTool  # noqa: F401
from tandem.rollout.tools.python import PythonTool  # noqa: F401  (registers "python")

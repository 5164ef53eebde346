"""The code sandbox: model-written Python run confined (namespaces, a root file system of its own, rlimits), and
assert-style tests judged by a harness it cannot reach. Used by the `code` reward and the `python` tool; knows
nothing else of tandem. `runner` launches and judges; `boot` is the confined side, run as its own interpreter."""
from __future__ import annotations

import logging
from typing import Sequence

from tandem.sandbox.runner import (  # noqa: F401
    BOOT,
    SandboxBroken,
    SandboxLimits,
    SandboxResult,
    isolation,
    judge_python,
    package_paths,
    run_python,
    self_test,
    weak_spots,
)

log = logging.getLogger("tandem.sandbox")

_WARNED: set[tuple[str, ...]] = set()  # package sets already warned about: once per run, not once per call


def check_sandbox(packages: Sequence[str] = (), allow_weak_sandbox: bool = False) -> None:
    """Refuse (SandboxBroken) a sandbox that fails its self-test, or a weak one unless `allow_weak_sandbox`; warn
    loudly, naming what is not contained, when a weak one is allowed. Checked once per package set."""
    iso = self_test(tuple(packages))
    spots = weak_spots(iso)
    if not spots:
        return
    what = "; ".join(spots)
    if not allow_weak_sandbox:
        raise SandboxBroken(
            f"the code sandbox is weak on this machine (isolation {iso}: no user or mount namespaces): a "
            f"model-written program could {what}. Run where unprivileged user namespaces are allowed "
            "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, or a container with them), "
            "or accept the risk with the code reward's kwargs: {allow_weak_sandbox: true}")
    if tuple(packages) not in _WARNED:
        _WARNED.add(tuple(packages))
        log.warning("!!! CODE SANDBOX IS WEAK (allow_weak_sandbox: true; isolation %s): a model-written program "
                    "could %s. Only rlimits, a new session and a scrubbed environment confine it.", iso, what)

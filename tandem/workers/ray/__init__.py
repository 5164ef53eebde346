"""The `ray` worker-group backend (`group.start_groups`); importing this package imports no Ray.

Its modules, highest first (pyproject.toml's contract on `tandem.workers.ray`): `group` places and starts the groups,
`gang` is the started groups as the controller calls them, `actor` what runs inside each actor, `session` the Ray
session and its reaper, `reaper.py` a script of the standard library alone, run by path."""
